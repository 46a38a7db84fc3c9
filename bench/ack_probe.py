"""`outbox relay` with the moment of each Kafka acknowledgement written down (benchmarks only).

    python bench/ack_probe.py ACKS_FILE [outbox's arguments ...]

Runs the ``outbox`` command as ``python -m outbox`` would, having first wrapped the two
places where a relay's Kafka client learns that a record landed: kafka-python's
``ProducerBatch.done`` (its sender thread, as the produce response is read) and the
transport seam's ``Report.landed`` (the librdkafka transport's delivery report, served by
its reporter thread). Each landing adds (partition, offset, wall-clock time) to one array of
doubles; at exit the array is written to ACKS_FILE (:func:`read_acks`). A record's op record
holds its partition and offset, so the benchmark finds each message's ack by them.

It also wraps ``Relay._send``, where a fetched batch is handed to the Kafka client: each
message's (id, wall-clock time) goes to ACKS_FILE.sends (:func:`read_sends`), so that
commit → ack splits into commit → handed over (the relay's wake-up and fetch) and handed
over → ack (the client and the broker).

The relay does what it always does; the probe costs a clock read and an append per record.
"""

from __future__ import annotations

import atexit
import runpy
import sys
import time
from array import array
from pathlib import Path
from typing import Any

ACKS = array("d")
SENDS = array("d")


def install() -> None:
    """Wraps the landing of a record in both clients, and the relay's hand-off of a batch to
    them (what the imported code has of these)."""
    from kafka.producer.producer_batch import ProducerBatch

    done = ProducerBatch.done

    def batch_done(batch: Any, base_offset: Any = None, timestamp_ms: Any = None,
                   top_level_exception: Any = None, record_exceptions_fn: Any = None) -> Any:
        at = time.time()  # before the records' futures wake the relay
        finished = done(batch, base_offset, timestamp_ms, top_level_exception,
                        record_exceptions_fn)
        if finished and top_level_exception is None and base_offset is not None:
            partition = batch.topic_partition.partition
            for offset in range(base_offset, base_offset + batch.record_count):
                ACKS.extend((partition, offset, at))  # one C call: atomic under the GIL
        return finished

    ProducerBatch.done = batch_done
    try:
        from outbox.relay.transport import Report
    except ImportError:  # an older relay (an A/B's old side): kafka-python's acks only
        return
    landed = Report.landed

    def report_landed(report: Any, partition: int, offset: int) -> None:
        ACKS.extend((partition, offset, time.time()))
        landed(report, partition, offset)

    Report.landed = report_landed  # type: ignore[method-assign]
    from outbox.relay.relay import Relay

    if not hasattr(Relay, "_send"):  # an older relay: no hand-off times
        return
    send = Relay._send

    def handed_over(relay: Any, *args: Any) -> Any:
        at = time.time()
        # a flight of rows (session 49 on), or an older relay's (transport, batch)
        rows = args[0].rows if len(args) == 1 else args[1]
        for row in rows:
            SENDS.extend((row.id, at))
        return send(relay, *args)

    Relay._send = handed_over  # type: ignore[method-assign]


def sends_file(path: Path) -> Path:
    """Where the probe writing acks to ``path`` writes the hand-offs."""
    return path.with_name(path.name + ".sends")


def _doubles(path: Path) -> array[float]:
    values = array("d")
    values.frombytes(path.read_bytes())
    return values


def read_acks(path: Path) -> tuple[list[int], list[int], list[float]]:
    """Partitions, offsets and ack times (seconds since the epoch) of a probe's file."""
    values = _doubles(path)
    return ([int(p) for p in values[0::3]], [int(o) for o in values[1::3]],
            list(values[2::3]))


def read_sends(path: Path) -> tuple[list[int], list[float]]:
    """Message ids and the moments they were handed to the Kafka client, of a probe's file
    (:func:`sends_file`)."""
    values = _doubles(sends_file(path))
    return [int(i) for i in values[0::2]], list(values[1::2])


def main() -> None:
    target = Path(sys.argv[1])

    def write() -> None:
        target.write_bytes(ACKS.tobytes())
        sends_file(target).write_bytes(SENDS.tobytes())

    atexit.register(write)
    install()
    sys.argv = ["outbox", *sys.argv[2:]]
    runpy.run_module("outbox", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
