"""What a tail read costs by its size: many topics' partitions read on one consumer.

    python bench/tail_read_bench.py [--topics 1000] [--partitions 4]
                                    [--per-read 100,1000] [--clients kafka-python,confluent]

``--topics`` topics of ``--partitions`` partitions are created in one request, and one record
with an ``outbox-id`` header is produced to each partition. Then each client's tail reader
(relay/tails.py, relay/confluent.py) reads every partition from its beginning, in reads of
``--per-read`` partitions, as a settle after a takeover does (relay/recovery.py): the seconds
for all of them, and whether every record was found. A read that fails is reported with its
error.
"""

from __future__ import annotations

import argparse
import threading
import time

from confluent_kafka import Producer
from relay_bench import say

from outbox.dev import services as devservices
from outbox.dev.topics import create_topics
from outbox.exceptions import ServiceUnavailable
from outbox.relay.tails import make_tail_reader
from outbox.settings import RelaySettings


def prepare(bootstrap: str, topics: list[str], partitions: int) -> None:
    create_topics(bootstrap, topics, partitions)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for n, topic in enumerate(topics):
        for p in range(partitions):
            producer.produce(topic, b"x" * 100, key=b"k", partition=p,
                             headers=[("outbox-id", b"%d" % (n * partitions + p + 1))])
        producer.poll(0)
    if producer.flush(120):
        raise SystemExit("the records were not all acknowledged in 120 s")


def read_all(bootstrap: str, client: str, topics: list[str], partitions: int, per_read: int
             ) -> tuple[float, int, str]:
    """Seconds, records found, and an error if a read failed."""
    settings = RelaySettings(database_url="postgresql://unused/unused", kafka_bootstrap=bootstrap,
                             kafka_client=client, worker_id="bench")
    reader = make_tail_reader(settings, threading.Event())
    starts = [((topic, p), None) for topic in topics for p in range(partitions)]
    found, started = 0, time.perf_counter()
    try:
        for i in range(0, len(starts), per_read):
            found += len(reader.read(dict(starts[i:i + per_read]), 1_000_000).found)
        return time.perf_counter() - started, found, ""
    except ServiceUnavailable as exc:
        return time.perf_counter() - started, found, str(exc)
    finally:
        reader.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topics", type=int, default=1000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--per-read", default="100,1000")
    parser.add_argument("--clients", default="kafka-python,confluent")
    args = parser.parse_args()
    say("starting embedded PostgreSQL and Kafka broker ...")
    services = devservices.start()
    try:
        topics = [f"tails-{i}" for i in range(args.topics)]
        started = time.perf_counter()
        prepare(services.kafka_bootstrap, topics, args.partitions)
        total = args.topics * args.partitions
        say(f"{args.topics:,} topics x {args.partitions} partitions, a record each, "
            f"made in {time.perf_counter() - started:.1f} s")
        for per_read in (int(size) for size in args.per_read.split(",")):
            for client in args.clients.split(","):
                seconds, found, error = read_all(services.kafka_bootstrap, client, topics,
                                                 args.partitions, per_read)
                outcome = f"FAILED: {error}" if error else f"{found:,} of {total:,} found"
                say(f"   {per_read:>6,} partitions a read, {client + ':':14} "
                    f"{seconds:7.2f} s  {outcome}")
    finally:
        devservices.stop(services)


if __name__ == "__main__":
    main()
