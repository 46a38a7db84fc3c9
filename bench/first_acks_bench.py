"""How long librdkafka takes to acknowledge one record in each of many topics.

    python bench/first_acks_bench.py [--topics 3000] [--modes precreate,lookup,none]

A librdkafka producer with the relay's settings (relay/confluent.py) sends one 1 KiB record
to each of ``--topics`` topics, and each record's ack latency (from its ``produce()``) is
timed. Modes: ``precreate``, the topics made beforehand (4 partitions each) and looked up
one by one on the producer, as the relay asks about topics new to it; ``lookup``, the same
look-ups making the topics (the embedded broker makes a topic when asked about it);
``none``, no look-up: the producer learns of each topic itself. The relay judges a topic
stuck when its records wait over 5 s while other topics' land (relay/relay.py,
``SLOW_ACK_SECONDS``), so the count of acks over 5 s is printed.
"""

from __future__ import annotations

import argparse
import time

from confluent_kafka import Producer
from relay_bench import PAYLOAD, say

from outbox.dev import services as devservices
from outbox.dev.topics import create_topics
from outbox.relay.confluent import librdkafka_config
from outbox.settings import RelaySettings


def first_acks(bootstrap: str, topics: list[str], mode: str) -> str:
    if mode == "precreate":
        create_topics(bootstrap, topics, partitions=4)
    settings = RelaySettings(database_url="postgresql://unused/unused",
                             kafka_bootstrap=bootstrap, kafka_client="confluent",
                             worker_id="bench")
    config = librdkafka_config(settings)
    del config["logger"]
    producer = Producer(config)
    started = time.perf_counter()
    if mode != "none":
        for topic in topics:
            producer.list_topics(topic, timeout=5)
    looked_up = time.perf_counter()
    latencies: list[float] = []
    for n, topic in enumerate(topics):
        sent = time.perf_counter()
        producer.produce(topic, PAYLOAD, key=b"k%d" % n,
                         on_delivery=lambda error, _, sent=sent: latencies.append(
                             time.perf_counter() - sent if error is None else float("inf")))
        producer.poll(0)
    producer.flush(120)
    done = time.perf_counter()
    latencies.sort()
    return (f"look-ups {looked_up - started:.1f} s, every ack {done - looked_up:.1f} s after "
            f"the first send; ack p50 {latencies[len(latencies) // 2]:.2f} s, p90 "
            f"{latencies[int(len(latencies) * 0.9)]:.2f} s, max {latencies[-1]:.2f} s; "
            f"{sum(1 for s in latencies if s > 5):,} over 5 s, "
            f"{len(topics) - len(latencies):,} unanswered")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topics", type=int, default=3000)
    parser.add_argument("--modes", default="precreate,lookup,none")
    args = parser.parse_args()
    for mode in args.modes.split(","):
        services = devservices.start()  # fresh each mode: the topics are new to the broker
        try:
            topics = [f"first-{i}" for i in range(args.topics)]
            say(f"{args.topics:,} topics, {mode + ':':10} "
                f"{first_acks(services.kafka_bootstrap, topics, mode)}")
        finally:
            devservices.stop(services)


if __name__ == "__main__":
    main()
