"""Reading the outbox tables over partitioned JDBC, and the topics' new offset ranges."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import reduce
from typing import Any
from urllib.parse import quote, urlencode

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from sqlalchemy.engine import make_url

from outbox import store
from outbox.encoding import ascii_digits
from outbox.exceptions import ConfigurationError
from outbox.settings import split_host, sqlalchemy_url
from outbox.spark.kafka_source import (
    CLIENTS,
    FORMAT,
    PASSWORD_OPTION,
    SPARK_SCHEMA,
    KafkaRangeSource,
    OffsetRange,
)

JDBC_DRIVER = "org.postgresql.Driver"
FETCH_SIZE = 10_000
#: libpq's parameters for a connection's TCP timeouts (settings.tcp_timeouts): pgjdbc has
#: its own names for two, and a session's server side takes the others (session_init).
LIBPQ_TCP_PARAMETERS = ("connect_timeout", "keepalives", "keepalives_idle",
                        "keepalives_interval", "keepalives_count", "tcp_user_timeout")


def session_init(tcp: Mapping[str, str]) -> str:
    """What each JDBC connection runs before its read:

    * no JIT: the subqueries are index range scans whose cost estimate crosses
      jit_above_cost at a few hundred thousand rows: JIT then compiles (and at 5M messages
      inlines and optimises) each one, about 180 ms per orphan-check range, and runs no
      faster;
    * none of the timeouts a DBA may set on the role (store.SET_ASIDE_SETTINGS, with the
      defaults that change how answers read, as every session of the outbox's): a read takes
      as long as its rows, and between two fetches of rows its session is idle in its
      transaction while Spark works;
    * the server's side of the TCP timeouts (``tcp``, libpq's parameters): pgjdbc cannot set
      them on its socket, and the session of an executor that vanished would live on for
      the server's kernel's two hours, holding back vacuum with its snapshot."""
    return store.settings_sql({**store.SET_ASIDE_SETTINGS, "jit": "off",
                               **store.server_tcp_settings(tcp)})


#: libpq's ``target_session_attrs`` as pgjdbc's ``targetServerType``.
TARGET_SERVER_TYPES = {"any": "any", "read-write": "primary", "primary": "primary",
                       "read-only": "secondary", "standby": "secondary",
                       "prefer-standby": "preferSecondary"}


def jdbc_options(database_url: str, tcp_timeout: float | None = None) -> dict[str, str]:
    """A ``postgresql://`` URL as the JDBC reader's options (the password stays an option),
    with ``tcp_timeout`` as the relay's connections take it (settings.tcp_timeouts). A URL
    naming several hosts (``?host=h1:5432&host=h2:5432``) names them all, in order."""
    url = make_url(sqlalchemy_url(database_url, tcp_timeout))
    params = {k: v if isinstance(v, str) else v[-1] for k, v in url.query.items()
              if k not in ("host", "target_session_attrs")}
    tcp = {name: params.pop(name) for name in LIBPQ_TCP_PARAMETERS if name in params}
    listed = url.query.get("host", ())
    hosts = [_host_port(url.host, url.port)] if url.host else [
        _host_port(*split_host(entry)) for entry in
        ((listed,) if isinstance(listed, str) else listed)]
    if not hosts or not url.database:
        raise ConfigurationError("the database URL needs a host and a database name for JDBC")
    attrs = url.query.get("target_session_attrs")
    if isinstance(attrs, str) and attrs in TARGET_SERVER_TYPES:
        params["targetServerType"] = TARGET_SERVER_TYPES[attrs]
    query = urlencode(params)
    options = {
        # pgjdbc cuts the name at "?" and URL-decodes it
        "url": f"jdbc:postgresql://{','.join(hosts)}/{quote(url.database, safe='')}"
               + (f"?{query}" if query else ""),
        "driver": JDBC_DRIVER,
        "fetchsize": str(FETCH_SIZE),
        "ApplicationName": "outbox-reconcile",
        "sessionInitStatement": session_init(tcp),
        # Binary results from the first execution (pgjdbc uses text until a statement has run
        # five times, and each subquery runs once): timestamps, bigints and bytea arrive as
        # bytes, not text to parse; reading the window costs about 15% less.
        "prepareThreshold": "-1",
    }
    if ascii_digits(tcp.get("connect_timeout", "")):
        options["connectTimeout"] = tcp["connect_timeout"]
    if tcp.get("keepalives", "1") != "0":
        options["tcpKeepAlive"] = "true"
    if url.username:
        options["user"] = url.username
    if url.password:
        options["password"] = str(url.password)
    return options


def _host_port(host: str, port: int | None) -> str:
    """One host of a JDBC URL: an IPv6 address in brackets, the port always."""
    return f"[{host}]:{port or 5432}" if ":" in host else f"{host}:{port or 5432}"


#: Rows one JDBC read takes at most when a window is large (a cached partition of about
#: 300 MB), and at least (a smaller read costs more than it parallelises).
MAX_ROWS_PER_READ = 2_500_000
MIN_ROWS_PER_READ = 50_000


def read_count(rows: int, cores: int, at_most: int) -> int:
    """How many parallel JDBC reads take ``rows`` rows: one per core of the session, more
    only to keep each under MAX_ROWS_PER_READ, never more than ``at_most``
    (reconcile_partitions) nor so many that one is under MIN_ROWS_PER_READ.

    More reads than cores only queue behind each other: on local[2], 2 reads of 5M rows
    took 10.0 s where 8 took 10.5-11.8 s (BENCHMARKS.md).
    """
    wanted = max(cores, -(-rows // MAX_ROWS_PER_READ))
    return max(1, min(at_most, wanted, rows // MIN_ROWS_PER_READ + 1))


def id_ranges(low: int, high: int, parts: int) -> list[tuple[int, int]]:
    """``[low, high]`` cut into at most ``parts`` inclusive ranges of similar width."""
    step = max(1, -(-(high - low + 1) // parts))
    return [(start, min(high, start + step - 1)) for start in range(low, high + 1, step)]


def read_jdbc(spark: SparkSession, options: Mapping[str, str],
              subqueries: list[str]) -> DataFrame:
    """One Spark partition per subquery (each bounded by its own id range)."""
    frames = [spark.read.format("jdbc").options(**options).option("dbtable", subquery).load()
              for subquery in subqueries]
    return reduce(DataFrame.unionByName, frames)


@dataclass(frozen=True)
class TopicPlan:
    """What to read of the topics, and which records are new since the last run."""

    ranges: list[OffsetRange]
    #: Records at or after these offsets were never seen by an earlier run.
    fresh_from: dict[tuple[str, int], int]
    #: The watermark this run leaves: {topic: {partition: next offset}}.
    read_to: dict[str, dict[str, int]]
    #: (topic, partition, last run's end, its end now) of partitions that end before the
    #: last run's end (recreated, or records lost), or whose first record shows they were
    #: recreated (recreated()). Read from their start, all new.
    rewound: list[tuple[str, int, int, int]] = field(default_factory=list)
    #: Records at or after these offsets (at most fresh_from) whose messages no run compared
    #: with them are checked again: those of later windows a topic run left to tables-only
    #: runs (see carry.LATER).
    recheck_from: dict[tuple[str, int], int] = field(default_factory=dict)
    #: The heads this run hands on (carry.HEADS): those it found, and the last run's of the
    #: partitions it did not ask about.
    heads: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)

    def read_from(self) -> dict[tuple[str, int], int]:
        """Where each partition was read from (its end, if nothing of it was read)."""
        starts = {(topic, int(partition)): end for topic, ends in self.read_to.items()
                  for partition, end in ends.items()}
        starts.update({(r.topic, r.partition): r.start for r in self.ranges})
        return starts


def plan_topics(ends: Mapping[tuple[str, int], int],
                window_offsets: Mapping[tuple[str, int], int],
                previous: Mapping[str, Mapping[str, int]] | None,
                from_beginning: bool,
                recheck: Mapping[tuple[str, int], int] | None = None,
                heads: Mapping[tuple[str, int], tuple[int, int]] | None = None,
                heads_before: Mapping[tuple[str, int], tuple[int, int]] | None = None
                ) -> TopicPlan:
    """Read from the last run's end (or the window's first op record, if earlier) to the end.

    ``window_offsets`` are the lowest offsets the window's op records name, so every record
    they point at is read. Without an earlier run, everything is new when the window starts
    at the beginning of time; otherwise only what lies at or after the window's op records.
    A partition that now ends before the last run's end, or whose first record shows it was
    recreated (``heads`` now against ``heads_before``, see recreated()), is read whole, all of
    it new. ``recheck``: offsets from which records seen before are read and checked again
    (those the last topic run left to later windows, when tables-only runs judged them).
    """
    ranges, fresh_from, rewound, recheck_from = [], {}, [], {}
    restarted = set(recreated(heads_before or {}, heads or {}))
    for (topic, partition), end in sorted(ends.items()):
        seen = None if previous is None else previous.get(topic, {}).get(str(partition))
        first_op = window_offsets.get((topic, partition))
        if seen is not None and (seen > end or (topic, partition) in restarted):
            rewound.append((topic, partition, seen, end))
            fresh = 0
        elif seen is not None:
            fresh = seen
        elif previous is not None or from_beginning:
            fresh = 0
        else:
            fresh = first_op if first_op is not None else end
        again = min(fresh, (recheck or {}).get((topic, partition), fresh))
        start = min(again, first_op) if first_op is not None else again
        fresh_from[(topic, partition)] = fresh
        recheck_from[(topic, partition)] = again
        if start < end:
            ranges.append(OffsetRange(topic, partition, start, end))
    read_to: dict[str, dict[str, int]] = {t: dict(p) for t, p in (previous or {}).items()}
    for (topic, partition), end in ends.items():
        read_to.setdefault(topic, {})[str(partition)] = end
    handed = {key: head for key, head in (heads_before or {}).items() if key not in ends}
    return TopicPlan(ranges, fresh_from, read_to, rewound, recheck_from,
                     {**handed, **(heads or {})})


def recreated(before: Mapping[tuple[str, int], tuple[int, int]],
              now: Mapping[tuple[str, int], tuple[int, int]]) -> list[tuple[str, int]]:
    """The partitions whose first record (offset, timestamp) shows they were deleted and
    recreated since ``before``: they begin at an earlier offset, or at the same one with a
    record of another time. One that begins later only lost its first records (retention,
    compaction)."""
    return sorted(key for key, (offset, at) in now.items() if key in before and (
        offset < before[key][0] or (offset == before[key][0] and at != before[key][1])))


def read_topics(spark: SparkSession, bootstrap: str, plan: TopicPlan,
                client: Mapping[str, Any] | None = None,
                max_records_per_split: int = 1_000_000,
                library: str = "kafka-python") -> DataFrame:
    """The planned offset ranges as records, each marked ``fresh`` or not, and ``recheck``
    (fresh, or to be checked again: TopicPlan.recheck_from).

    ``library``: the Kafka client the executors read with, ``kafka-python`` or ``confluent``
    (the ``confluent`` extra, librdkafka); ``client``: its security settings
    (settings.KafkaSettings.kafka_security, in that client's names).
    """
    if library not in CLIENTS:
        raise ConfigurationError(
            f"unknown Kafka client {library!r}: use one of {', '.join(CLIENTS)}")
    if library == "confluent" and importlib.util.find_spec("confluent_kafka") is None:
        raise ConfigurationError(
            "OUTBOX_KAFKA_CLIENT=confluent needs the confluent-kafka package: "
            "pip install 'transactional-outbox[confluent]'")
    if plan.ranges:
        spark.dataSource.register(KafkaRangeSource)
        settings = dict(client or {})
        password = settings.pop(PASSWORD_OPTION[library], None)
        reader = (spark.read.format(FORMAT).option("bootstrap", bootstrap)
                  .option("ranges", json.dumps([[r.topic, r.partition, r.start, r.end]
                                                for r in plan.ranges]))
                  .option("library", library)
                  .option("client", json.dumps(settings))
                  .option("max_records_per_split", str(max_records_per_split)))
        if password is not None:
            reader = reader.option(PASSWORD_OPTION[library], password)
        records = reader.load()
    else:
        records = spark.createDataFrame([], SPARK_SCHEMA)
    marks = spark.createDataFrame(
        [(t, p, o, plan.recheck_from.get((t, p), o)) for (t, p), o in plan.fresh_from.items()]
        or [("", -1, 0, 0)], "topic string, partition int, fresh_from long, recheck_from long")
    return (records.join(F.broadcast(marks), ["topic", "partition"], "left")
            .select(records["*"], (F.col("offset") >= F.col("fresh_from")).alias("fresh"),
                    (F.col("offset") >= F.col("recheck_from")).alias("recheck")))
