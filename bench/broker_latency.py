"""Produce → ack latency of the bare Kafka clients against the embedded broker, with nothing
else running: on an empty topic, then on the same topic holding ``--fill`` records.

    python bench/broker_latency.py [--seconds 60] [--rate 1000] [--fill 600000]
    python bench/broker_latency.py --beside HOST:PORT [--client confluent] [--rate 200]

The relay's commit → ack includes this part (its hand-off → ack, `bench/soak.py`); this run
says what it costs with the database idle, and whether it grows with what the broker holds
(the embedded broker keeps every record in memory), for each client with the relay's
producer settings.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

from confluent_kafka import Producer
from kafka import KafkaProducer
from relay_bench import produce_here

from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.relay.confluent import librdkafka_config
from outbox.relay.producer import PRODUCER_DEFAULTS, KeyHashPartitioner
from outbox.settings import RelaySettings

PAYLOAD = b"x" * 1024
KEYS = 1000

class Client:
    """One client with the relay's producer settings, sending to one topic."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.topic = topic

    def send(self, key: bytes, landed: Callable[[], None]) -> None:
        """Hands one record over; ``landed()`` is called once it is acknowledged."""
        raise NotImplementedError

    def wait(self, seconds: float) -> None:
        """Passes up to ``seconds`` (serving the client's callbacks if it needs that)."""
        time.sleep(seconds)

    def close(self) -> None:
        raise NotImplementedError


class Confluent(Client):
    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(bootstrap, topic)
        self.producer = Producer(librdkafka_config(RelaySettings(kafka_bootstrap=bootstrap)))

    def send(self, key: bytes, landed: Callable[[], None]) -> None:
        def report(error: object, _message: object) -> None:
            if error is None:
                landed()

        self.producer.produce(self.topic, PAYLOAD, key, on_delivery=report)
        self.producer.poll(0)

    def wait(self, seconds: float) -> None:
        self.producer.poll(seconds)

    def close(self) -> None:
        self.producer.flush(30)


class KafkaPython(Client):
    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(bootstrap, topic)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, **PRODUCER_DEFAULTS,
                                      partitioner=KeyHashPartitioner())

    def send(self, key: bytes, landed: Callable[[], None]) -> None:
        self.producer.send(self.topic, value=PAYLOAD, key=key).add_callback(
            lambda _metadata: landed())

    def close(self) -> None:
        self.producer.close(30)


CLIENTS: dict[str, type[Client]] = {"kafka-python": KafkaPython, "confluent": Confluent}


def paced(client: Client, seconds: float, rate: float) -> list[float]:
    """Sends ``rate`` records a second for ``seconds``; each record's seconds to its ack."""
    latencies: list[float] = []

    def took(since: float) -> None:
        latencies.append(time.monotonic() - since)

    started = time.monotonic()
    sent = 0
    while (now := time.monotonic()) - started < seconds:
        due = started + sent / rate
        if now < due:
            client.wait(due - now)
            continue
        client.send(b"key-%d" % (sent % KEYS), functools.partial(took, now))
        sent += 1
    client.wait(1.0)  # the last records' acks
    return latencies


def row(client: str, topic: str, latencies: list[float]) -> str:
    cuts = statistics.quantiles(latencies, n=100)
    return (f"| {client} | {topic} | {len(latencies):,} | {cuts[49] * 1000:.2f} ms | "
            f"{cuts[98] * 1000:.2f} ms | {max(latencies) * 1000:.1f} ms |")


def beside(bootstrap: str, name: str, minutes: float, seconds: float, rate: float) -> None:
    """The bare client's produce → ack beside whatever else runs on the machine (a latency
    soak's relay, PostgreSQL and pgbench), to a topic of its own."""
    topic = f"beside-{name}"
    create_topic(bootstrap, topic, partitions=6)
    client = CLIENTS[name](bootstrap, topic)
    try:
        print("| client | window | records | p50 | p99 | max |\n|---|---|---|---|---|---|")
        for window in range(int(minutes * 60 / seconds)):
            print(row(name, f"{window + 1}", paced(client, seconds, rate)), flush=True)
    finally:
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--rate", type=float, default=1000)
    parser.add_argument("--fill", type=int, default=600_000)
    parser.add_argument("--beside", metavar="BOOTSTRAP",
                        help="no services of its own: measure against this running broker, "
                        "a row per --seconds, for --minutes (beside another benchmark)")
    parser.add_argument("--minutes", type=float, default=3)
    parser.add_argument("--client", choices=CLIENTS, default="kafka-python")
    args = parser.parse_args()
    if args.beside:
        beside(args.beside, args.client, args.minutes, args.seconds, args.rate)
        return
    print("starting fresh embedded PostgreSQL (durable, idle) and Kafka broker ...", flush=True)
    services = devservices.start(durable=True)
    try:
        bootstrap = f"127.0.0.1:{services.kafka_port}"
        rows = ["| client | topic | records | p50 | p99 | max |", "|---|---|---|---|---|---|"]
        for name, make in CLIENTS.items():
            topic = f"latency-{name}"
            create_topic(bootstrap, topic, partitions=6)
            client = make(bootstrap, topic)
            try:
                rows.append(row(name, "empty", paced(client, args.seconds, args.rate)))
                print(rows[-1], flush=True)
                rate = produce_here(bootstrap, topic, args.fill, name, key_memo=True)
                print(f"  filled with {args.fill:,} records at {rate:,.0f} msg/s", flush=True)
                rows.append(row(name, f"holding {args.fill:,}",
                                paced(client, args.seconds, args.rate)))
                print(rows[-1], flush=True)
            finally:
                client.close()
        print("\n".join(["", *rows]))
    finally:
        devservices.stop(services)


if __name__ == "__main__":
    main()
