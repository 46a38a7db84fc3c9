"""Names are checked whole: nothing PostgreSQL or Kafka would mangle or refuse gets through."""

from __future__ import annotations

import pytest

from outbox import InvalidMessage
from outbox.encoding import validate_topic
from outbox.exceptions import ConfigurationError
from outbox.settings import MAX_SCHEMA_LENGTH, validate_identifier


@pytest.mark.parametrize("topic", ["orders\n", "orders\r\n", "\norders", "ord ers", "", ".",
                                   "..", "a" * 250])
def test_a_topic_is_matched_whole(topic: str) -> None:
    with pytest.raises(InvalidMessage, match="invalid Kafka topic name"):
        validate_topic(topic)


@pytest.mark.parametrize("topic", ["orders", "a.b-c_D9", "a" * 249])
def test_valid_topics_pass(topic: str) -> None:
    assert validate_topic(topic) == topic


@pytest.mark.parametrize("name", ["evil\n", "outbox\n", "Outbox", "1abc", "a-b", "",
                                  "pg_catalog", "pg_toast", "information_schema",
                                  "user", "order", "group", "default", "left", "public",
                                  "a" * (MAX_SCHEMA_LENGTH + 1)])
def test_a_schema_name_postgres_would_mangle_or_refuse_is_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match="schema name") as raised:
        validate_identifier(name)
    assert "\n" not in str(raised.value).replace("\\n", "")


def test_the_longest_schema_name_leaves_room_for_every_role_suffix() -> None:
    name = "s" * MAX_SCHEMA_LENGTH
    assert validate_identifier(name) == name
    assert len(f"{name}_reconcile") <= 63


def test_the_default_worker_id_differs_between_processes_with_the_same_host_and_pid() -> None:
    from outbox.settings import default_worker_id

    ids = {default_worker_id() for _ in range(50)}
    assert len(ids) == 50


@pytest.mark.parametrize("worker_id", ["", " ", "relay 1", "a\n", "relé-1"])
def test_an_empty_spaced_or_non_ascii_worker_id_is_refused(worker_id: str) -> None:
    """Not ASCII, it named sessions PostgreSQL renames (application_name keeps printable
    ASCII only): the relay did not find its own lost session again, and took it for a twin."""
    from outbox.settings import RelaySettings, load_settings

    with pytest.raises(ConfigurationError, match="worker_id"):
        load_settings(RelaySettings, worker_id=worker_id)


def test_a_reconciliation_sla_past_ten_years_is_refused_in_one_line() -> None:
    """A huge SLA ("never") put the window's end before year 1: a traceback at the run."""
    from outbox.settings import ReconcileSettings, load_settings

    with pytest.raises(ConfigurationError, match="reconcile_sla_seconds"):
        load_settings(ReconcileSettings, reconcile_sla_seconds=1e11)
