"""Passwords never appear where settings are printed, whatever form the URL takes."""

from __future__ import annotations

import pytest

from outbox.exceptions import ConfigurationError
from outbox.settings import Settings, mask_url, sqlalchemy_url


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        ("postgresql://app:hunter2@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        ("postgresql://app@db/shop?password=hunter2&sslmode=require",
         "postgresql://app@db/shop?password=***&sslmode=require"),
        ("postgresql://app:s3@cr3t@db/shop", "postgresql://app:***@db/shop"),
        ("host=db password=hunter2 dbname=shop", "host=db password=*** dbname=shop"),
        ("postgresql://app:p@db/shop?sslpassword=hunter2", "postgresql://app:***@db/shop?sslpassword=***"),
    ],
)
def test_every_form_of_password_is_masked(url: str, masked: str) -> None:
    shown = mask_url(url)
    assert "hunter2" not in shown and "cr3t" not in shown
    assert sorted(shown.split()) == sorted(masked.split())


def test_the_config_output_masks_a_query_parameter_password() -> None:
    settings = Settings(database_url="postgresql://app@db/shop?password=hunter2")
    assert "hunter2" not in str(settings.masked())


@pytest.mark.parametrize("url", ["host=db password=hunter2 dbname=shop",
                                 "postgresql://app:s3@cr3t@db/shop"])
def test_an_invalid_url_error_does_not_echo_the_password(url: str) -> None:
    with pytest.raises(ConfigurationError) as raised:
        sqlalchemy_url(url)
    assert "hunter2" not in str(raised.value) and "cr3t" not in str(raised.value)
