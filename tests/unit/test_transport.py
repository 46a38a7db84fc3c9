"""The transports agree: librdkafka gets the same settings under its own names, and its errors
are classified like kafka-python's. No broker needed."""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import kafka.errors
import pytest
from confluent_kafka import KafkaError
from kafka.producer.future import FutureProduceResult, FutureRecordMetadata
from kafka.producer.record_accumulator import RecordAccumulator

from outbox import store
from outbox.exceptions import ConfigurationError, describe
from outbox.relay import confluent
from outbox.relay.confluent import librdkafka_config, translate
from outbox.relay.producer import Sent, producer_config
from outbox.relay.tails import KafkaPythonTailReader, Tail, fingerprint
from outbox.relay.transport import (
    Report,
    UnknownOffset,
    UnsendableRecord,
    is_permanent,
    make_transport,
    refuses_topic,
)
from outbox.settings import Settings


def test_kafka_sasl_and_tls_settings_reach_librdkafka_under_its_names(tmp_path: Path) -> None:
    files = {name: tmp_path / name for name in ("ca.pem", "relay.pem", "relay.key")}
    for path in files.values():
        path.touch()
    settings = Settings(kafka_bootstrap="k1:9093,k2:9093", kafka_security_protocol="SASL_SSL",
                        kafka_sasl_mechanism="SCRAM-SHA-512", kafka_sasl_username="relay",
                        kafka_sasl_password="s3cret", kafka_ssl_cafile=str(files["ca.pem"]),
                        kafka_ssl_certfile=str(files["relay.pem"]),
                        kafka_ssl_keyfile=str(files["relay.key"]))
    config = librdkafka_config(settings)
    assert config["bootstrap.servers"] == "k1:9093,k2:9093"
    assert config["security.protocol"] == "SASL_SSL"
    assert config["sasl.mechanisms"] == "SCRAM-SHA-512"
    assert (config["sasl.username"], config["sasl.password"]) == ("relay", "s3cret")
    assert config["ssl.ca.location"] == str(files["ca.pem"])
    assert config["ssl.certificate.location"] == str(files["relay.pem"])
    assert config["ssl.key.location"] == str(files["relay.key"])
    assert not {"security_protocol", "sasl_plain_password", "ssl_cafile"} & set(config)


def test_librdkafka_producer_is_idempotent_ordered_and_partitions_like_java() -> None:
    settings = Settings(kafka_bootstrap="k1:9093", kafka_max_request_size=20_000,
                        kafka_delivery_timeout_ms=30_000)
    config = librdkafka_config(settings)
    assert (config["acks"], config["enable.idempotence"]) == ("all", True)
    assert config["max.in.flight.requests.per.connection"] <= 5
    assert config["partitioner"] == "murmur2_random"
    assert config["message.max.bytes"] == 20_000
    assert config["batch.size"] <= config["message.max.bytes"]
    assert config["message.timeout.ms"] == 30_000


@pytest.mark.parametrize("delivery_timeout_ms", [1_000, 10_000, 30_000, 120_000])
def test_any_accepted_delivery_timeout_makes_a_producer_kafka_python_accepts(
    delivery_timeout_ms: int
) -> None:
    """kafka-python refuses a delivery timeout under linger + request timeout (30 s by
    default): a request's timeout is shortened to fit in it, in both clients."""
    settings = Settings(kafka_bootstrap="k1:9093", kafka_delivery_timeout_ms=delivery_timeout_ms)
    config = producer_config(settings)
    RecordAccumulator(**config)  # raises KafkaConfigurationError if the timeouts do not fit
    assert config["request_timeout_ms"] == min(30_000, delivery_timeout_ms - config["linger_ms"])
    rdkafka = librdkafka_config(settings)
    assert rdkafka["request.timeout.ms"] == config["request_timeout_ms"]
    assert rdkafka["message.timeout.ms"] == delivery_timeout_ms


def test_the_connect_timeout_reaches_every_kafka_python_client() -> None:
    settings = Settings(kafka_bootstrap="k1:9093", kafka_connect_timeout_ms=2_500)
    assert producer_config(settings)["bootstrap_timeout_ms"] == 2_500
    assert KafkaPythonTailReader(settings)._config["bootstrap_timeout_ms"] == 2_500


def test_a_tail_skips_outbox_id_headers_no_relay_wrote() -> None:
    """Another producer's ``outbox-id`` header in a topic's tail: ``int()`` of it ended the
    relay reading it, and every relay that took the shards over read the same tail."""
    tail = Tail()
    for offset, value in enumerate([b"abc", b"12a", b"-5", b"0", b"9" * 20,
                                    "\u0661\u0662", b"42", "43"]):
        tail.add("t", 0, offset, b"k", b"v", [("outbox-id", value)])
    assert tail.found == {fingerprint(42, "t", b"k", b"v"): (0, 6),
                          fingerprint(43, "t", b"k", b"v"): (0, 7)}
    assert tail.ids() == [42, 43]
    assert tail.records == 8


def test_unset_security_settings_are_left_to_librdkafkas_defaults() -> None:
    config = librdkafka_config(Settings(kafka_bootstrap="k1:9093"))
    assert config["security.protocol"] == "PLAINTEXT"
    assert not [name for name in config if name.startswith(("sasl.", "ssl."))]


@pytest.mark.parametrize("code", [
    KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.INVALID_RECORD, KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.REQUEST_TIMED_OUT, KafkaError.UNKNOWN_TOPIC_OR_PART,
])
def test_broker_errors_are_classified_as_kafka_python_classifies_them(code: int) -> None:
    kafka_python = kafka.errors.for_code(code)
    error = translate(KafkaError(code))
    assert type(error) is kafka_python
    assert is_permanent(error) == (not kafka_python.retriable)


@pytest.mark.parametrize(("code", "about_the_topic"), [
    (KafkaError.TOPIC_AUTHORIZATION_FAILED, True), (KafkaError.INVALID_TIMESTAMP, True),
    (KafkaError.UNSUPPORTED_FOR_MESSAGE_FORMAT, True), (KafkaError.TOPIC_EXCEPTION, True),
    (KafkaError.CLUSTER_AUTHORIZATION_FAILED, False),
    (KafkaError.SASL_AUTHENTICATION_FAILED, False), (KafkaError.INVALID_REQUIRED_ACKS, False),
    (KafkaError.UNSUPPORTED_VERSION, False),
])
def test_errors_about_a_topic_or_the_producers_grants_park_no_record(
    code: int, about_the_topic: bool
) -> None:
    """A topic's are held (relay/holds.py); the producer's on the whole cluster are outages."""
    error = translate(KafkaError(code))
    assert not kafka.errors.for_code(code).retriable
    assert refuses_topic(error) == about_the_topic and not is_permanent(error)


def test_the_brokers_unknown_server_error_is_the_same_error_and_parks_nothing() -> None:
    """-1 is Kafka's UNKNOWN_SERVER_ERROR (librdkafka's RD_KAFKA_RESP_ERR_UNKNOWN): the
    broker's fault, not the record's, under either transport."""
    error = translate(KafkaError(KafkaError.UNKNOWN))
    assert type(error) is kafka.errors.for_code(-1) is kafka.errors.UnknownError
    assert not is_permanent(error) and not is_permanent(kafka.errors.UnknownError())
    assert not refuses_topic(error)


@pytest.mark.parametrize("code", [KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT,
                                  KafkaError._ALL_BROKERS_DOWN, KafkaError._UNKNOWN_TOPIC,
                                  KafkaError._PURGE_QUEUE])
def test_librdkafkas_own_connection_and_timeout_errors_are_retriable(code: int) -> None:
    assert not is_permanent(translate(KafkaError(code)))


@pytest.mark.parametrize("code", [KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH,
                                  KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
                                  KafkaError.UNKNOWN_PRODUCER_ID])
def test_errors_about_the_producer_itself_never_park_a_record(code: int) -> None:
    """Not retriable for kafka-python, but a new producer sends the record fine."""
    error = translate(KafkaError(code))
    assert not kafka.errors.for_code(code).retriable and not is_permanent(error)


def test_a_too_large_record_reads_the_same_with_both_transports() -> None:
    error = translate(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
    assert isinstance(error, kafka.errors.MessageSizeTooLargeError) and is_permanent(error)


def test_choosing_confluent_without_the_package_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # import fails as if absent
    monkeypatch.delitem(sys.modules, "outbox.relay.confluent")
    settings = Settings(kafka_bootstrap="k1:9093", kafka_client="confluent")
    with pytest.raises(ConfigurationError) as raised:
        make_transport(settings)
    message = str(raised.value)
    assert "\n" not in message
    assert "pip install 'transactional-outbox[confluent]'" in message


def test_an_acknowledgement_without_an_offset_is_retried_not_recorded() -> None:
    """Both clients report a DUPLICATE_SEQUENCE_NUMBER answer as success at offset -1; a broker
    that restarted with its producer state but not its records answers so (seen on Tansu with
    object storage, tests/integration/test_broker_modes.py's history): recording it would
    lose the message. librdkafka's report fills a Report; kafka-python's future is read."""
    delivery = Report()
    delivery.landed(1, -1)
    assert delivery.settled and delivery.offset == -1
    assert isinstance(delivery.error, UnknownOffset) and not is_permanent(delivery.error)
    sent = kafka_python_sent(offset=-1)
    assert isinstance(sent.error, UnknownOffset) and not is_permanent(sent.error)


@pytest.mark.parametrize(("names", "values"), [
    (["a", "b"], [b"1"]), (["a"], [None]), ([None], [b"1"]), ([["a", "b"]], [[b"1", b"2"]]),
    (None, [b"1"]),
])
def test_a_stored_row_whose_headers_do_not_pair_up_is_unsendable_and_parked(
    names: Any, values: Any
) -> None:
    """Rows ``publish_message()`` stored before revision 0018 checked its arguments: the
    relay refuses such a row before sending, as a permanent error (tests/integration/
    test_migrations.py runs it through a relay)."""
    with pytest.raises(store.UnpairedHeaders) as raised:
        store.paired_headers(names, values)
    error = UnsendableRecord(f"message 7: {raised.value}")
    assert is_permanent(error) and not refuses_topic(error)
    assert describe(error).startswith("UnsendableRecord: message 7: its ")
    assert store.paired_headers(["a"], [b"1"]) == [("a", b"1")]
    assert store.paired_headers(None, None) == []


def test_a_kafka_python_error_is_described_by_its_name_once() -> None:
    assert describe(UnknownOffset("partition 3")) == "UnknownOffset: partition 3"
    assert describe(kafka.errors.MessageSizeTooLargeError("too big")) == \
        "MessageSizeTooLargeError: [Error 10] too big"
    assert describe(ValueError("bad")) == "ValueError: bad"


def kafka_python_sent(*, offset: int | None = None, error: Exception | None = None) -> Sent:
    """What kafka-python's producer hands back for one record, settled as a broker would."""
    batch = FutureProduceResult(("orders", 2))
    sent = Sent(FutureRecordMetadata(batch, 4, 0, None, 1, 1, -1))
    if error is None:
        batch.success((offset, -1, None))
    else:
        batch.failure(error)
    return sent


def test_kafka_python_s_answer_is_read_from_its_future() -> None:
    landed = kafka_python_sent(offset=96)  # the batch's base offset; the record is 5th in it
    assert (landed.error, landed.partition, landed.offset) == (None, 2, 100)
    refused = kafka_python_sent(error=kafka.errors.MessageSizeTooLargeError("1 MB"))
    assert isinstance(refused.error, kafka.errors.MessageSizeTooLargeError)
    assert is_permanent(refused.error)
    waiting = Sent(FutureRecordMetadata(FutureProduceResult(("orders", 0)), 0, 0, None, 1, 1, -1))
    assert waiting.error is None, "not settled yet: no error to act on"


def test_librdkafka_lines_repeat_at_most_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(confluent.time, "monotonic", lambda: clock[0])
    repeats = confluent.Repeats()

    def passes(line: str, *args: object) -> str | None:
        record = logging.LogRecord("outbox.relay.librdkafka", logging.ERROR, "", 0, line, args,
                                   None)
        return record.getMessage() if repeats.filter(record) else None

    refused = "FAIL [%s]: Connect to 127.0.0.1:%d failed (after %dms in state CONNECT)"
    assert passes(refused, "producer-1", 9092, 0) is not None
    clock[0] += 1
    assert passes(refused, "producer-1", 9092, 3) is None, "the same line but for a number"
    assert passes("another line") is not None
    clock[0] += 58
    assert passes(refused, "producer-1", 9092, 1) is None
    clock[0] += 1
    assert passes(refused, "producer-1", 9092, 0) == (
        "FAIL [producer-1]: Connect to 127.0.0.1:9092 failed (after 0ms in state CONNECT) "
        "(and 2 like it in the last 60s)")


def test_a_refusal_that_names_another_topic_of_the_batch_is_that_topics() -> None:
    """kafka-python's producer, stopped by one topic's refusal, fails the other topics'
    records with that same error: the other topics must not be held for it."""
    from types import SimpleNamespace

    from outbox.relay.relay import refused_topic

    flights: Any = [SimpleNamespace(rows=[SimpleNamespace(topic="orders"),
                                          SimpleNamespace(topic="denied")])]
    error = kafka.errors.TopicAuthorizationFailedError("denied")
    assert refused_topic(error, "orders", flights, {}) == "denied"
    assert refused_topic(error, "denied", flights, {}) == "denied"
    elsewhere = kafka.errors.TopicAuthorizationFailedError("not-in-the-batch")
    assert refused_topic(elsewhere, "orders", flights, {}) == "orders"
    # a held topic tried again, its refused records settled in an earlier pass
    assert refused_topic(elsewhere, "orders", flights, {}, {"not-in-the-batch"}) == \
        "not-in-the-batch"
    blamed: dict[int, str] = {}
    timestamp = kafka.errors.InvalidTimestampError("denied")  # a broker's message, not a topic
    assert refused_topic(timestamp, "denied", flights, blamed) == "denied"
    assert refused_topic(timestamp, "orders", flights, blamed) == "denied", "the same error"
    again = kafka.errors.InvalidTimestampError("denied")
    assert refused_topic(again, "orders", flights, blamed) == "orders", "an error of its own"


def test_a_refused_topic_tried_again_with_nothing_to_send_is_let_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its messages left this relay's shards (or were discarded): no answer will come, and
    the hold (and its gauge) must not stay for ever."""
    from prometheus_client import REGISTRY

    from outbox.relay import holds as holds_module
    from outbox.settings import RelaySettings

    settings = RelaySettings(database_url="postgresql://u@h/db", kafka_bootstrap="h:9092")
    held: Any = holds_module.TopicHolds(settings, transport=None)  # type: ignore[arg-type]
    writes: list[tuple[str, object]] = []  # the database writes, in their order

    def write(name: str, conn: object, schema: str, what: object, *args: object) -> object:
        if name == "flagged_topics":
            return {}  # no other relay's flags
        writes.append((name, what))
        return 0

    for name in ("mark_held", "try_held", "release_held", "flagged_topics"):
        monkeypatch.setattr(holds_module.store, name, functools.partial(write, name))
    monkeypatch.setattr(holds_module, "TRIAL_SECONDS", 0.0)
    conn = mock.MagicMock()  # begin() is a context manager; no statement runs on it
    held.refused("gone", "TopicAuthorizationFailedError: gone")
    held.revisit(conn, [0])  # held
    assert held.topics == ["gone"]
    assert ("mark_held", {"gone": held._held["gone"].reason}) in writes
    held._held["gone"].retry_at = 0.0  # its back-off has passed
    writes.clear()
    held.revisit(conn, [0])  # tried
    assert held.tried == {"gone"}
    assert writes == [("try_held", {"gone"})], "its first held rows rejoin the fetch"
    held.revisit(conn, [0])  # no answer within the trial
    assert held.tried == frozenset() and held.topics == []
    assert writes[-1] == ("release_held", {"gone"}), "all its rows rejoin the fetch"
    assert REGISTRY.get_sample_value("outbox_topic_held", {"topic": "gone"}) == 0
