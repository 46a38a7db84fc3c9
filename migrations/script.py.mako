"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

import sqlalchemy as sa
from alembic import op

from migrations import target_schema

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade() -> None:
    schema = target_schema()
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    schema = target_schema()
    ${downgrades if downgrades else "pass"}
