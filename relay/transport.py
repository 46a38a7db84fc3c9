"""The seam between the relay and a Kafka client: send a record, learn where it landed.

Two transports sit behind it: kafka-python (the default, relay/producer.py) and librdkafka
through confluent-kafka (``OUTBOX_KAFKA_CLIENT=confluent``, relay/confluent.py, an optional
extra). Both are idempotent with acks=all and at most 5 requests in flight, so per-key order
holds, and both map a key to the same partition (murmur2, like the Java client), so switching
transports never moves a key. Their errors reach the relay as kafka-python's exception classes,
so two functions decide what an error means: :func:`refuses_topic` (the topic is held) and
:func:`is_permanent` (the record is parked after a few attempts); any other error is an
outage.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, wait
from typing import Protocol

from kafka.errors import (
    AuthorizationError,
    IllegalSaslStateError,
    InvalidProducerEpochError,
    InvalidRequiredAcksError,
    InvalidTimestampError,
    InvalidTopicError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumberError,
    ProducerFencedError,
    SaslAuthenticationFailedError,
    TopicAuthorizationFailedError,
    UnknownError,
    UnknownProducerIdError,
    UnsupportedForMessageFormatError,
    UnsupportedVersionError,
)

from outbox.exceptions import ConfigurationError, ServiceUnavailable, describe
from outbox.settings import RelaySettings

Headers = Sequence[tuple[str, bytes]]


#: Batches sent but not yet recorded: the database work of one overlaps the next ones' sends.
#: A transport holds this many batches' records at most.
PIPELINE_DEPTH = 4


class UnknownOffset(KafkaError):  # type: ignore[misc]  # kafka-python is untyped
    """An acknowledgement without an offset. Both clients report a DUPLICATE_SEQUENCE_NUMBER
    answer so (the broker says it holds the record already); a broker that lost its log but
    kept its producer state answers the same. Sending again risks a duplicate; recording it
    would lose the message and its position, so the relay retries it."""

    retriable = True
    description = "the broker acknowledged the record without its offset"


class UnsendableRecord(KafkaError):  # type: ignore[misc]
    """A stored row the relay cannot make a record of (store.UnpairedHeaders): refused before
    sending, like a record too large, so it is parked after a few attempts."""

    retriable = False
    description = "the stored row cannot be made a Kafka record"


class Delivery(Protocol):
    """Where one record landed, or why it did not: read once the transport's :meth:`wait`
    says it settled (``error`` may be set at once: a record refused before sending)."""

    @property
    def error(self) -> BaseException | None: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...


class Report:
    """A delivery filled in once, from any thread, by a client's delivery report."""

    __slots__ = ("error", "offset", "partition", "settled")

    def __init__(self) -> None:
        self.partition = -1
        self.offset = -1
        self.error: BaseException | None = None
        self.settled = False

    def landed(self, partition: int, offset: int) -> None:
        if offset < 0:
            self.failed(unknown_offset(partition))
            return
        self.partition, self.offset = partition, offset
        self.settled = True

    def failed(self, error: BaseException) -> None:
        self.error = error
        self.settled = True


def unknown_offset(partition: int) -> UnknownOffset:
    return UnknownOffset(f"partition {partition}")


class Transport(Protocol):
    #: of the topics :meth:`available` found unknown, those Kafka would not describe to the
    #: relay's principal (TOPIC_AUTHORIZATION_FAILED: no Describe ACL), rather than not have
    denied: frozenset[str]
    #: whether the relay fetches its next batch while it sends one (relay/prefetch.py): worth
    #: it where ``send`` holds the interpreter (kafka-python), not where it is cheap C
    fetch_ahead: bool

    def send(self, topic: str, key: bytes | None, value: bytes, headers: Headers) -> Delivery:
        """Hand one record over; a record refused before sending (too large, ...) comes back
        already failed."""
        ...

    def unsent(self, error: BaseException) -> Delivery:
        """A delivery failed with ``error`` before anything was handed over (a row the relay
        cannot make a record of), settled as the transport's own are."""
        ...

    def wait(self, deliveries: Sequence[Delivery], timeout: float) -> bool:
        """Whether every one of ``deliveries`` (sent here) has settled, landed or failed,
        waiting up to ``timeout`` seconds (0: just look): one wait for a batch instead of a
        callback per record (relay/producer.py's ``Sent`` says what those cost)."""
        ...

    def available(self, topics: Collection[str], timeout: float) -> set[str]:
        """Which of ``topics`` Kafka has metadata (partitions) for, asking it for at most
        ``timeout`` seconds; the others are unknown to it. Raises ServiceUnavailable if no
        broker answered: that is an outage, not a missing topic."""
        ...

    def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for every record handed over to be settled."""
        ...

    def broken(self) -> bool:
        """Whether the producer has stopped for good (a fatal error, such as a broker that
        fences it after rejecting a record): everything sent from now on fails, and the
        relay builds a new transport."""
        ...

    def close(self, timeout: float) -> None:
        """Flush for up to ``timeout`` seconds (0: abandon what is unsent) and disconnect."""
        ...


#: Errors about the producer's own id, epoch or sequence, never about a record (a broker may
#: answer them to every record after it rejected one): the producer is built anew
#: (:meth:`Transport.broken`) and the records are sent again.
PRODUCER_STATE_ERRORS = (ProducerFencedError, InvalidProducerEpochError,
                         OutOfOrderSequenceNumberError, UnknownProducerIdError)


#: Non-retriable errors about a topic, not its records: no Write ACL on it, a timestamp bound
#: the relay's clock is outside (the relay stamps each record as it sends it), a message
#: format too old for headers, a name Kafka keeps for itself.
TOPIC_ERRORS = (TopicAuthorizationFailedError, InvalidTimestampError,
                UnsupportedForMessageFormatError, InvalidTopicError)
#: Non-retriable errors about the producer's grants or settings on the whole cluster (no
#: IdempotentWrite grant, a failed login, a broker too old): an outage until mended.
CLUSTER_ERRORS = (AuthorizationError, SaslAuthenticationFailedError, IllegalSaslStateError,
                  InvalidRequiredAcksError, UnsupportedVersionError)
#: Non-retriable in Kafka's protocol, but the broker's own fault (UNKNOWN_SERVER_ERROR), not the
#: record's: retried as an outage, never counted toward parking.
BROKER_FAULTS = (UnknownError,)


def refuses_topic(error: BaseException | None) -> bool:
    """Kafka refuses the record for its topic's sake: the topic is held
    (relay/holds.py), every record of it would be refused alike."""
    return isinstance(error, TOPIC_ERRORS)


def is_permanent(error: BaseException | None) -> bool:
    """Kafka's non-retriable errors about a record (too large, invalid, corrupt, ...):
    retrying the same record cannot help, so it is parked after a few attempts."""
    return (isinstance(error, KafkaError) and not error.retriable
            and not isinstance(error, PRODUCER_STATE_ERRORS + TOPIC_ERRORS + CLUSTER_ERRORS
                               + BROKER_FAULTS))


def failure_reason(error: BaseException | None, settings: RelaySettings) -> str:
    """What a failed record's row and its PARKED op record say (:func:`describe`); a record
    too large also names the limits an operator can raise (kafka-python's text names its own
    ``max_request_size``, librdkafka's none)."""
    reason = describe(error)
    if isinstance(error, MessageSizeTooLargeError):
        reason += (f" (the record is larger than OUTBOX_KAFKA_MAX_REQUEST_SIZE, "
                   f"{settings.kafka_max_request_size} bytes, or the broker's message.max.bytes)")
    return reason


def make_transport(settings: RelaySettings) -> Transport:
    """The transport ``settings.kafka_client`` names, connected to the brokers."""
    settings.require("kafka_bootstrap")
    if settings.kafka_client == "confluent":
        try:
            from outbox.relay.confluent import ConfluentTransport
        except ModuleNotFoundError as exc:
            if exc.name != "confluent_kafka":
                raise
            raise ConfigurationError(
                "OUTBOX_KAFKA_CLIENT=confluent needs the confluent-kafka package: "
                "pip install 'transactional-outbox[confluent]'") from None
        return ConfluentTransport(settings)
    from outbox.relay.producer import KafkaPythonTransport

    return KafkaPythonTransport(settings)


#: How often a wait for a broker looks whether it was told to stop.
STOP_CHECK_SECONDS = 0.2


def make_transport_unless(settings: RelaySettings, stopping: threading.Event) -> Transport:
    """:func:`make_transport`, made in a thread of its own so that ``stopping`` ends the wait
    for a broker with :class:`ServiceUnavailable`: that wait lasts ``kafka_connect_timeout_ms``
    (15 s by default, longer than Docker's grace between SIGTERM and SIGKILL) while no broker
    answers. A transport made after the stop is closed."""
    made: Future[Transport] = Future()

    def make() -> None:
        try:
            made.set_result(make_transport(settings))
        except BaseException as exc:  # the caller's to raise
            made.set_exception(exc)

    threading.Thread(target=make, daemon=True, name=f"kafka-connect-{settings.worker_id}").start()
    while not stopping.is_set():
        if wait([made], STOP_CHECK_SECONDS).done:
            return made.result()
    made.add_done_callback(_close_unwanted)
    raise ServiceUnavailable("stopped before Kafka answered")


def _close_unwanted(made: Future[Transport]) -> None:
    if made.exception() is None:
        made.result().close(timeout=0)
