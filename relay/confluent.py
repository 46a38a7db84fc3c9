"""The librdkafka transport (``OUTBOX_KAFKA_CLIENT=confluent``; the ``confluent`` extra).

librdkafka batches, compresses and retries in C threads; Python only hands records over and
reads delivery reports. Reports arrive only from ``poll()``, so a reporter thread polls with a
timeout (it sleeps until a report or the timeout comes, never spins). Errors are translated
into kafka-python's exception classes, so :func:`outbox.relay.transport.is_permanent` parks
exactly what the kafka-python transport parks and a parked message's reason reads the same.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Collection, Sequence
from typing import Any

import kafka.errors
from confluent_kafka import (
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)

from outbox.exceptions import ConfigurationError, ServiceUnavailable
from outbox.relay.producer import PRODUCER_DEFAULTS, request_timeout_ms
from outbox.relay.tails import LOG_START, Stall, Starts, Tail, named
from outbox.relay.transport import (
    PIPELINE_DEPTH,
    PRODUCER_STATE_ERRORS,
    Delivery,
    Headers,
    Report,
)
from outbox.settings import RelaySettings

log = logging.getLogger("outbox.relay.librdkafka")
#: librdkafka logs each failed connection attempt (several a second while a broker is down);
#: a line is repeated at most this often, with the count of those left out since.
REPEAT_SECONDS = 60.0
#: The broker's -1, which librdkafka passes on as RD_KAFKA_RESP_ERR_UNKNOWN; its own error
#: codes are below it.
UNKNOWN_SERVER_ERROR = KafkaError.UNKNOWN
#: librdkafka's own (negative) error codes with a kafka-python twin; any other local error
#: (connection, timeout, queue) is retriable.
LOCAL_ERRORS: dict[int, type[kafka.errors.KafkaError]] = {
    KafkaError._MSG_TIMED_OUT: kafka.errors.KafkaTimeoutError,
    KafkaError._TIMED_OUT: kafka.errors.KafkaTimeoutError,
    KafkaError._UNKNOWN_TOPIC: kafka.errors.UnknownTopicOrPartitionError,
    KafkaError._UNKNOWN_PARTITION: kafka.errors.UnknownTopicOrPartitionError,
    KafkaError._INVALID_ARG: kafka.errors.IllegalArgumentError,
}
#: How long the reporter thread waits for a report before checking whether to stop.
POLL_SECONDS = 0.2
#: How long a tail read's consume waits for its batch of 10,000 records to fill: it returns
#: only then, so a read's last wait is this long (0.2 s cost every read 0.2 s).
CONSUME_SECONDS = 0.02


class Repeats(logging.Filter):
    """Lets a log line through once per ``REPEAT_SECONDS`` (lines differing only in numbers,
    such as "after 3ms", are the same line); the next one says how many were left out."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        #: per line: when it last went through, and how many were left out since
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        line = re.sub(r"\d+", "N", record.getMessage())
        now = time.monotonic()
        with self._lock:
            shown_at, left_out = self._seen.get(line, (-REPEAT_SECONDS, 0))
            if now - shown_at < REPEAT_SECONDS:
                self._seen[line] = (shown_at, left_out + 1)
                return False
            self._seen[line] = (now, 0)
        if left_out:
            record.msg = f"{record.getMessage()} (and {left_out} like it in the last " \
                         f"{now - shown_at:.0f}s)"
            record.args = None
        return True


log.addFilter(Repeats())


def librdkafka_config(settings: RelaySettings) -> dict[str, Any]:
    """The kafka-python transport's producer settings in librdkafka's names."""
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        "client.id": f"outbox-relay-{settings.worker_id}",
        "acks": "all",
        "enable.idempotence": True,
        # Idempotence keeps order with up to 5 requests in flight per partition.
        "max.in.flight.requests.per.connection": 5,
        # kafka-python's and the Java client's key -> partition mapping (not librdkafka's).
        "partitioner": "murmur2_random",
        "linger.ms": PRODUCER_DEFAULTS["linger_ms"],
        "batch.size": min(PRODUCER_DEFAULTS["batch_size"], settings.kafka_max_request_size),
        "message.max.bytes": settings.kafka_max_request_size,
        "message.timeout.ms": settings.kafka_delivery_timeout_ms,
        **queue_room(settings),
        "request.timeout.ms": request_timeout_ms(settings),
        "logger": log,
        **settings.kafka_security("librdkafka"),
    }


def queue_room(settings: RelaySettings) -> dict[str, int]:
    """Room in librdkafka's queue for every record the relay's pipeline may hold. A send
    into a full queue waits for room, which a frozen broker frees only at the delivery
    timeout, and no stop ends that wait; the defaults (100,000 records, 1 GiB) held less
    than four batches of 25,001 records or of 257 MiB. A record's key and headers are
    counted at 1 KiB."""
    batch_bytes = max(settings.relay_batch_bytes, settings.kafka_max_request_size)
    return {
        "queue.buffering.max.messages": max(100_000, PIPELINE_DEPTH * settings.relay_batch_size),
        "queue.buffering.max.kbytes": max(
            1024 * 1024, PIPELINE_DEPTH * (batch_bytes // 1024 + settings.relay_batch_size)),
    }


def consumer_config(settings: RelaySettings) -> dict[str, Any]:
    """A consumer for reading tails: assigned partitions only, nothing committed; it stops
    at each partition's end (the high-watermark of its fetch responses)."""
    return {
        "bootstrap.servers": settings.kafka_bootstrap,
        "client.id": f"outbox-recovery-{settings.worker_id}",
        "group.id": f"outbox-recovery-{settings.worker_id}",  # required; never joined
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "fetch.wait.max.ms": 10,  # an empty tail ends after one short fetch
        # librdkafka stops fetching for 1 s (its default) once 100,000 records wait in its
        # queue: a long tail would stall that long every few hundred thousand records.
        "fetch.queue.backoff.ms": 10,
        "auto.offset.reset": "earliest",
        "logger": log,
        **settings.kafka_security("librdkafka"),
    }


def translate(error: KafkaError) -> kafka.errors.KafkaError:
    """librdkafka's error as the kafka-python exception the same failure raises there."""
    code = error.code()
    if code >= UNKNOWN_SERVER_ERROR:
        cls = kafka.errors.for_code(code)
    else:
        cls = LOCAL_ERRORS.get(code, kafka.errors.KafkaConnectionError)
    return cls(f"{error.str()} ({error.name()})")


class ConfluentTransport:
    """confluent-kafka's producer behind the relay's transport seam (relay/transport.py)."""

    fetch_ahead = False  # a drain A/B with it: 0.87 of the rate, CPU a message 15.5 -> 17.1 µs

    def __init__(self, settings: RelaySettings) -> None:
        try:
            self.producer = Producer(librdkafka_config(settings))
        except KafkaException as exc:
            raise ConfigurationError(f"invalid Kafka settings for librdkafka: {exc}") from None
        try:
            self.producer.list_topics(timeout=settings.kafka_connect_timeout_ms / 1000)
        except KafkaException:
            raise settings.kafka_unreachable() from None
        self._closing = threading.Event()
        self.denied: frozenset[str] = frozenset()
        #: a fatal error, or one about the producer's own id (PRODUCER_STATE_ERRORS): this
        #: producer sends nothing more
        self._fatal = False
        #: notified after each poll that served delivery reports (:meth:`wait`)
        self._reports = threading.Condition()
        self._reporter = threading.Thread(target=self._report, daemon=True,
                                          name=f"kafka-reports-{settings.worker_id}")
        self._reporter.start()

    def send(self, topic: str, key: bytes | None, value: bytes, headers: Headers) -> Delivery:
        delivery = Report()

        def reported(error: KafkaError | None, message: Message) -> None:
            if error is None:
                offset = message.offset()
                delivery.landed(message.partition() or 0, -1 if offset is None else offset)
            else:
                failure = translate(error)
                self._fatal = self._fatal or error.fatal() or isinstance(
                    failure, PRODUCER_STATE_ERRORS)
                delivery.failed(failure)

        while True:
            try:
                self.producer.produce(topic, value, key, headers=list(headers),
                                      on_delivery=reported)
                return delivery
            except BufferError:  # librdkafka's queue is full: wait for reports to free it
                self._poll()
            except KafkaException as exc:  # refused before sending: size, unknown topic, ...
                self._fatal = self._fatal or exc.args[0].fatal()
                delivery.failed(translate(exc.args[0]))
                return delivery

    def unsent(self, error: BaseException) -> Delivery:
        delivery = Report()
        delivery.failed(error)
        return delivery

    def wait(self, deliveries: Sequence[Delivery], timeout: float) -> bool:
        """Woken after each poll that served reports; looks on from the first unsettled."""
        waiting = iter(deliveries)
        first: list[Any] = [next(waiting, None)]

        def settled() -> bool:
            while first[0] is not None and first[0].settled:
                first[0] = next(waiting, None)
            return first[0] is None

        with self._reports:
            return self._reports.wait_for(settled, timeout)

    def available(self, topics: Collection[str], timeout: float) -> set[str]:
        """One metadata request per topic (the relay asks only about topics it has not
        seen yet, and about held ones with back-off)."""
        found, denied = set(), set()
        for topic in topics:
            try:
                listed = self.producer.list_topics(topic, timeout=timeout).topics.get(topic)
            except KafkaException as exc:
                raise ServiceUnavailable(f"Kafka did not answer a metadata request within "
                                         f"{timeout:g}s: {exc.args[0].str()}") from None
            if listed is not None and listed.error is None and listed.partitions:
                found.add(topic)
            elif listed is not None and listed.error is not None \
                    and listed.error.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                denied.add(topic)
        self.denied = self.denied - set(topics) | denied
        return found

    def flush(self, timeout: float) -> None:
        try:
            self.producer.flush(timeout)
        except KafkaException:  # a fatal error: the records fail, see broken()
            self._fatal = True

    def broken(self) -> bool:
        return self._fatal

    def close(self, timeout: float) -> None:
        if self._closing.is_set():  # closed already (a relay that stepped aside)
            return
        if timeout > 0:
            self.producer.flush(timeout)
        else:  # abandon: what is not acknowledged stays pending in the database, and is
            # not sent again from here (as kafka-python's close(0) drops its sends in flight)
            self.producer.purge(in_queue=True, in_flight=True)
        self._closing.set()
        self._reporter.join()

    def _report(self) -> None:
        """Serve delivery reports (and librdkafka's log lines) as they come."""
        while not self._closing.is_set():
            self._poll()

    def _poll(self) -> None:
        try:
            served = self.producer.poll(POLL_SECONDS)
        except KafkaException:  # a fatal error (see broken()); the records it failed are
            self._fatal = served = True  # still reported by later polls
        if served:
            with self._reports:
                self._reports.notify_all()


class ConfluentTailReader:
    """Tails read with a librdkafka consumer of their own (relay/tails.py)."""

    #: 1,000 topics of 4 partitions, one record each, on the embedded broker: 5.6 s in
    #: reads of 100 partitions, 4.0 s in reads of 1,000, 2.6 s in reads of 2,000
    #: (BENCHMARKS.md, "Tail reads")
    partitions_per_read = 2_000

    def __init__(self, settings: RelaySettings, stop: threading.Event | None = None) -> None:
        self._bootstrap = settings.kafka_bootstrap
        self._stop = stop or threading.Event()
        self._config = consumer_config(settings)
        self._lookups: Consumer | None = None
        #: how long a metadata request may go unanswered (kafka-python's reader: its
        #: bootstrap_timeout_ms); then the takeover is retried as an outage
        self._answer_within = settings.kafka_connect_timeout_ms / 1000

    def _consumer(self) -> Consumer:
        try:
            return Consumer(self._config)
        except KafkaException as exc:
            raise ConfigurationError(f"invalid Kafka settings for librdkafka: {exc}") from None

    def close(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
            self._lookups = None

    def partitions(self, topic: str) -> int:
        """On the reader's look-up consumer, made at its first look-up."""
        if self._lookups is None:
            self._lookups = self._consumer()
        try:
            found = self._lookups.list_topics(topic, timeout=self._answer_within
                                              ).topics.get(topic)
        except KafkaException as exc:
            self.close()
            raise ServiceUnavailable(f"no metadata for topic {topic} ({exc})") from None
        return 0 if found is None or found.error is not None else len(found.partitions)

    def read(self, starts: Starts, limit: int) -> Tail:
        tail = Tail()
        consumer = self._consumer()
        try:
            consumer.assign([TopicPartition(topic, p, LOG_START if start is None
                                            else start) for (topic, p), start in starts.items()])
            ended: set[tuple[str, int]] = set()
            stall = Stall(self._bootstrap, self._stop)
            while len(ended) < len(starts):
                if tail.records >= limit:
                    tail.complete = False
                    break
                stall.check()
                reached: set[tuple[str, int]] = set()
                for message in consumer.consume(num_messages=min(10_000, limit - tail.records),
                                                timeout=CONSUME_SECONDS):
                    stall.progressed()
                    error = message.error()
                    if error is None:
                        headers = message.headers()
                        tail.add(message.topic() or "", message.partition() or 0,
                                 message.offset() or 0,
                                 message.key(), message.value(),
                                 headers.items() if isinstance(headers, dict) else headers)
                    elif error.code() == KafkaError._PARTITION_EOF:
                        reached.add((message.topic() or "", message.partition() or 0))
                    else:
                        raise ServiceUnavailable(f"could not read the tails of "
                                                 f"{named(starts)} ({error.str()})")
                reached |= _beyond_end(consumer, starts)
                if reached - ended:
                    # librdkafka fetches a partition at its end again and again; with many
                    # partitions that kept the broker busy (BENCHMARKS.md, "Tail reads")
                    consumer.pause([TopicPartition(t, p) for t, p in reached - ended])
                    ended |= reached
            return tail
        finally:
            consumer.close()



def _beyond_end(consumer: Consumer, starts: Starts) -> set[tuple[str, int]]:
    """Partitions whose start is past the high-watermark of their last fetch (the topic was
    recreated): librdkafka reports no end for them, and they have no tail to read."""
    beyond = set()
    for (topic, partition), start in starts.items():
        if start is not None:
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                     cached=True)
            if 0 <= high < start:
                beyond.add((topic, partition))
    return beyond
