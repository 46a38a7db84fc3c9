"""What a takeover costs: the time to read N records of partition tails and record them.

    python bench/takeover_bench.py [--messages 10000,100000] [--clients kafka-python,confluent]
                                   [--topics 1]

For each size: N pending 1 KiB messages (1000 keys, 6 partitions) are produced to the topic
with their ids in headers, as a relay would before being killed, and their shards are left
unclean under an expired lease. A new owner claims the 64 shards and settles them
(relay/recovery.py): it reads the N records of tail and records each message as delivered
where it is. Nothing was recorded before, so the tails start at the partitions' beginnings. With
``--topics K`` the messages are spread over K topics (created on first use, one partition
each): what a takeover costs per topic.
"""

from __future__ import annotations

import argparse
import time

from kafka import KafkaProducer
from relay_bench import PAYLOAD, bulk_publish, preload, say
from sqlalchemy import create_engine, text

from outbox import migrate
from outbox.dev import services as devservices
from outbox.dev.topics import create_topic
from outbox.relay.leases import Leases
from outbox.relay.recovery import Recovery
from outbox.settings import RelaySettings, sqlalchemy_url


def produce_as_dead_relay(bootstrap: str, rows: list[tuple[int, str, bytes]]) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap.split(","), acks="all",
                             linger_ms=5, batch_size=256 * 1024)
    for id_, topic, key in rows:
        producer.send(topic, value=PAYLOAD, key=key,
                      headers=[("outbox-id", b"%d" % id_),
                               ("content-type", b"application/octet-stream")])
    producer.flush()
    producer.close()


def takeover(services: devservices.Services, n: int, client: str, topics: int = 1
             ) -> tuple[float, int, int]:
    """Seconds to settle, records read, messages recorded."""
    name = f"{n}_{topics}_{client.replace('-', '_')}"
    schema, topic = f"takeover_{name}", f"takeover-{name.replace('_', '-')}"
    migrate.upgrade(services.database_url, schema)
    engine = create_engine(sqlalchemy_url(services.database_url))
    try:
        if topics == 1:
            create_topic(services.kafka_bootstrap, topic, partitions=6)
            preload(engine, schema, topic, n)
        else:
            with engine.begin() as conn:
                for i in range(topics):
                    conn.execute(bulk_publish(schema), {
                        "topic": f"{topic}-{i}", "payload": PAYLOAD, "n": n // topics,
                        "status": "PENDING"})
        with engine.begin() as conn:
            rows = [(r.message_id, r.topic, bytes(r.key)) for r in conn.execute(text(
                f"SELECT message_id, topic, key FROM {schema}.pending ORDER BY message_id"))]
            conn.execute(text(f"UPDATE {schema}.relay_lease SET owner = 'dead', clean = false, "
                              "expires_at = now() - interval '1 second'"))
        produce_as_dead_relay(services.kafka_bootstrap, rows)
        settings = RelaySettings(database_url=services.database_url,
                                 kafka_bootstrap=services.kafka_bootstrap, kafka_client=client,
                                 schema_name=schema, worker_id="heir")
        leases = Leases(schema, "heir", 3600)  # no keeper renews them here
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            leases.tick(conn)
            assert len(leases.unsettled) == 64
            started = time.perf_counter()
            Recovery(settings).settle(conn, leases)
            seconds = time.perf_counter() - started
            recorded = conn.execute(text(
                f"SELECT count(*) FROM {schema}.op_record WHERE actor = 'heir (recovered)'"
            )).scalar_one()
        return seconds, len(rows), int(recorded)
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", default="10000,100000")
    parser.add_argument("--clients", default="kafka-python,confluent")
    parser.add_argument("--topics", type=int, default=1, help="spread the messages over K")
    args = parser.parse_args()
    say("starting embedded PostgreSQL (durable: fsync on) and Kafka broker ...")
    services = devservices.start(durable=True)
    try:
        say(f"takeover: read N records of tail and record them (1 KiB; {args.topics} topics)")
        for n in (int(size) for size in args.messages.split(",")):
            for client in args.clients.split(","):
                seconds, read, recorded = takeover(services, n, client, args.topics)
                say(f"   {n:>9,} records, {client + ':':14} {seconds:7.2f} s  "
                    f"{read / seconds:10,.0f} records/s  ({recorded:,} recorded)")
    finally:
        devservices.stop(services)


if __name__ == "__main__":
    main()
