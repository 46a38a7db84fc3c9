"""queries.sql's blocks, as store reads them: a block's ``{name}`` of another block is that
block's text, so two queries share one condition (``held_back``) instead of two copies."""

from __future__ import annotations

import re

from outbox import store


def test_every_include_is_resolved_and_only_placeholders_are_left() -> None:
    for name, body in store._raw_queries().items():
        assert set(re.findall(r"\{(\w+)\}", body)) <= {"schema", "range"}, name


def test_an_included_block_comes_without_its_comments_or_semicolon() -> None:
    blocks = store._raw_queries()
    held_back = blocks["held_back"]
    condition = held_back[held_back.index("EXISTS"):]
    assert "--" not in condition and not condition.endswith(";")
    for name in ("fetch_deliverable", "fetch_batch", "try_held"):
        assert f"NOT {condition}\n" in blocks[name], name
    ids = blocks["fetch_deliverable"]
    ids = ids[ids.index("SELECT p.message_id"):].removesuffix(";")
    assert f"FROM ({ids}) AS i" in blocks["fetch_batch"]


def test_the_batch_statement_names_its_range_and_nothing_else_is_left() -> None:
    sql = store._batch_sql("outbox", "message_p1")
    assert "outbox.message_p1 AS m" in sql and "{" not in sql
