"""The reconciliation job: ``outbox reconcile`` locally; on a cluster, spark-submit runs the
same CLI (``outbox/__main__.py reconcile``, same options; pass the JDBC driver with
``--jars``). The job never imports the CLI: the CLI drives the job.

A run covers a window of prepare rows by created_at: from the last run's end (or
``--since``) to ``--until`` (default: now minus the SLA, never past the oldest open
transaction). It reads the window's rows and op records over partitioned JDBC, with the
messages the last run left open (spark/carry.py) and, with ``read_topics``, the topics from
where the last run stopped to their high-watermark; finds what contradicts "every committed
message is in Kafka exactly where its op record says" (per-key order starting from each
key's last position in earlier runs); writes Parquet, what it carries over and a short
report under the output directory; records a summary row. Its cost follows the window and
what is still open, not the history.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg
from kafka.errors import KafkaTimeoutError
from py4j.protocol import Py4JJavaError
from pyspark import SparkContext
from pyspark.errors import PySparkRuntimeError, PythonException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from sqlalchemy import Engine, NullPool, func, select
from sqlalchemy.exc import DBAPIError

from outbox import store
from outbox.exceptions import ConfigurationError, describe, server_trouble
from outbox.findings import FINDINGS, thresholds
from outbox.migrate import require_current
from outbox.settings import ReconcileSettings
from outbox.spark import carry, findings, queries, report, runs, sources
from outbox.spark.kafka_source import LogBounds, log_bounds
from outbox.spark.progress import Progress
from outbox.spark.runs import RunOutcome
from outbox.tls_probe import require_tls_answer

log = logging.getLogger("outbox.reconcile")
#: Message ids listed per finding in the report and summary (all are in the Parquet files).
SAMPLE_IDS = 10


@dataclass(frozen=True)
class Result:
    run_id: int
    outcome: RunOutcome
    window: queries.Window
    #: Count per finding that was checked.
    counts: dict[str, int]
    exceeded: list[str]
    output_path: Path
    summary: dict[str, Any]
    report: str

    @property
    def exit_code(self) -> int:
        """0 when no finding is over its threshold, 1 otherwise (for cron and orchestrators)."""
        return 1 if self.outcome is RunOutcome.FAILED else 0


def local_session(settings: ReconcileSettings) -> SparkSession:
    """The session: spark-submit's when launched by it, else local[*] with the JDBC jar. A
    local session's driver listens on the loopback address; one whose executors run
    elsewhere (``reconcile_spark_master`` a cluster's) must be reachable from them."""
    submitted = "PYSPARK_GATEWAY_PORT" in os.environ
    master = settings.reconcile_spark_master or (None if submitted else "local[*]")
    if master is not None and master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("outbox-reconcile").config(
        "spark.sql.session.timeZone", "UTC")
    if not sys.stderr.isatty():  # its progress bars, drawn with carriage returns, ran into
        builder = builder.config("spark.ui.showConsoleProgress", "false")  # the log's lines
    if master:
        builder = builder.master(master)
    if not submitted:
        if not Path(settings.reconcile_jdbc_jar).is_file():
            raise ConfigurationError(
                f"PostgreSQL JDBC driver not found at {settings.reconcile_jdbc_jar}: install "
                "libpostgresql-jdbc-java or set OUTBOX_RECONCILE_JDBC_JAR")
        builder = (builder.config("spark.jars", settings.reconcile_jdbc_jar)
                   .config("spark.driver.memory", "4g")
                   .config("spark.sql.shuffle.partitions", "8")
                   # The window's rows are cached once and scanned by every finding: building
                   # the compressed cache cost more than the scans it saved (about 0.6 s per
                   # million rows on local[2]); a million rows take ~120 MB uncompressed.
                   .config("spark.sql.inMemoryColumnarStorage.compressed", "false"))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    return spark


#: What the disk says when the run's files no longer fit, or it fails them.
_DISK_TROUBLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG})
#: An error line of a Python or Java traceback: ``package.Name(Error|Exception...): text``.
_ERROR_LINE = re.compile(r"^(?:[\w$]+\.)*\w*(?:Error|Exception|Timeout\w*): .+")


def job_failure(exc: BaseException) -> str | None:
    """The innermost error line of a Spark job that failed as it ran (an executor lost Kafka,
    or the database's JDBC read failed: an outage, not a bug), or None for any other error.
    Its tracebacks ran to 400 lines, with the exit code of a run that found too much. The
    database lost by the job's own connections is an outage too (it exited 2, a usage
    error's code), and so is a disk that fails the run's files (it exited 1)."""
    if isinstance(exc, psycopg.Error | DBAPIError) and server_trouble(exc):
        return describe(exc)
    if isinstance(exc, OSError) and exc.errno in _DISK_TROUBLE:  # the run's own files
        return f"{type(exc).__name__}: {exc}"
    if not isinstance(exc, PythonException | Py4JJavaError):
        return None
    return _error_line(exc)


def _error_line(exc: BaseException) -> str:
    """The innermost error line of a Python or Java traceback, else its first line."""
    lines = [line.strip().removeprefix(": ").removeprefix("Caused by: ")
             for line in str(exc).splitlines()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return errors[-1] if errors else next((line for line in lines if line), type(exc).__name__)


def _started(settings: ReconcileSettings) -> SparkSession:
    """local_session, or one line when Spark does not start: a master it cannot reach or run
    under gave a Python traceback and exit code 1, a run that found too much to a cron job.
    A signal while it starts stops it once started: raised in the middle of PySpark's
    launch, it left the JVM running with no one to stop it."""
    global _starting
    _starting = True
    try:
        spark = local_session(settings)
    except (PySparkRuntimeError, Py4JJavaError) as exc:
        master = settings.reconcile_spark_master or "local[*]"
        raise ConfigurationError(
            f"Spark did not start with master {master!r} (nothing was recorded; Spark's own "
            f"lines above say why): {_error_line(exc)}") from None
    finally:
        _starting = False
    signum = stopped_by()
    if signum is not None:  # stopped as it started: its JVM, cut off then, lived on
        spark.stop()
        raise Stopped(signum)
    return spark


class Stopped(BaseException):
    """A signal stopped the run before it was recorded (a BaseException, as KeyboardInterrupt
    is: no ``except Exception`` takes it for an error to report)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: The signal that is stopping this process's run, if one is.
_stopping: list[int] = []
#: Whether Spark is starting: a signal then waits for it (see _started).
_starting = False


def stopped_by() -> int | None:
    """The signal that stopped the run, or None."""
    return _stopping[0] if _stopping else None


def stop_on_signals() -> None:
    """SIGTERM, Ctrl-C and SIGHUP stop the run: before Spark starts at once (Stopped), after
    it by stopping the SparkContext from a thread of its own, so that the job in hand fails
    as a lost executor's does and the run is undone on its usual path (``_run``'s folder
    removed, nothing recorded); the command then says it was stopped. An exception raised in
    the handler instead would cut a call to the JVM in half and leave its answer for the next
    call to read. A second signal raises Stopped at once. SIGTERM killed a run without a
    word, leaving a half-written folder; Ctrl-C (PySpark's own handler, installed again by
    each new SparkContext: call this after the session starts) gave a traceback and exit code
    1, a run that found too much."""
    def on_signal(signum: int, _frame: FrameType | None) -> None:
        context = SparkContext._active_spark_context
        if _stopping or (context is None and not _starting):
            _stopping[:1] = [signum]
            raise Stopped(signum)
        _stopping.append(signum)
        log.info("%s: stopping the run (nothing will be recorded; signal again to stop at "
                 "once)", signal.Signals(signum).name)
        if context is not None and not _starting:
            threading.Thread(target=context.stop, name="outbox-reconcile-stop",
                             daemon=True).start()

    for signum in _STOP_SIGNALS:
        signal.signal(signum, on_signal)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """stop_on_signals for the block; then the handlers as they were, and no stop pending
    (a test's process runs the command many times)."""
    previous = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    stop_on_signals()
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stopping.clear()


@contextlib.contextmanager
def session(settings: ReconcileSettings) -> Iterator[SparkSession]:
    """The active session, or a new one (see local_session) stopped when the block ends."""
    active = SparkSession.getActiveSession()
    spark = active or _started(settings)
    try:
        yield spark
    finally:
        if active is None:
            spark.stop()


def preflight(settings: ReconcileSettings, *, since: datetime | None = None,
              until: datetime | None = None) -> None:
    """What a run needs, checked before Spark starts (which takes seconds and prints its own
    lines): known findings in the thresholds, the database and its migrated schema, a
    role that can hold the window back, a window given by hand that lies in the past, an
    output folder it can write, and with ``reconcile_read_topics`` a broker that lets it in
    (within ``kafka_connect_timeout_ms``). ``run`` checks them all again."""
    thresholds(settings.reconcile_thresholds)
    engine = store.engine(settings.sqlalchemy_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            require_current(conn, settings.schema_name)
            runs.require_hold_back(conn)
            runs.require_recording(conn, settings.schema_name)
            # the last run's end is read under the run lock (run), not here: a run holding
            # its table would keep this one from saying it is in progress
            _require_past(since, until, conn.execute(select(func.now())).scalar_one(), None)
    finally:
        engine.dispose()
    _output_root(settings)
    if settings.reconcile_read_topics:
        settings.require("kafka_bootstrap")
        _log_bounds(settings, set())


def _log_bounds(settings: ReconcileSettings, topics: set[str]) -> LogBounds:
    """Where each partition of ``topics`` ends and what it begins with; one line if no broker
    lets us in."""
    require_tls_answer(settings)  # kafka-python's handshake has no deadline
    try:
        return log_bounds(settings.kafka_bootstrap, sorted(topics),
                          settings.kafka_python_connection())
    except KafkaTimeoutError:
        raise settings.kafka_unreachable() from None


def run(spark: SparkSession, settings: ReconcileSettings, *, since: datetime | None = None,
        until: datetime | None = None) -> Result:
    """Reconcile one window and record it; see the module docstring. Raises RunInProgress,
    having done nothing, while another run of the schema is under way."""
    if settings.reconcile_read_topics:
        settings.require("kafka_bootstrap")
    engine = store.engine(settings.sqlalchemy_url, pool_size=2)
    try:
        with runs.one_at_a_time(engine, settings.schema_name), Progress(
                spark.sparkContext, log, settings.reconcile_progress_seconds) as progress:
            return _run(spark, settings, engine, since, until, progress)
    finally:
        engine.dispose()


def _run(spark: SparkSession, settings: ReconcileSettings, engine: Engine,
         since: datetime | None, until: datetime | None, progress: Progress) -> Result:
    started_at = datetime.now(UTC)
    clock_start = time.monotonic()
    limits = thresholds(settings.reconcile_thresholds)
    output_root = _output_root(settings)
    schema = settings.schema_name
    cached: list[DataFrame] = []
    output: Path | None = None
    recorded = False
    try:
        with engine.connect() as conn:
            require_current(conn, schema)
            runs.require_hold_back(conn)
            runs.require_recording(conn, schema)
            clock = queries.window_end(conn, until, settings.reconcile_sla_seconds)
            mark = queries.watermark(conn, schema)
            conn.rollback()
        _require_past(since, until, clock.now, mark.until)
        window, source = _window(since, mark, clock)
        timings: dict[str, float] = {}
        with _phase(timings, progress, "read tables"):
            spark.sparkContext.setJobDescription("outbox reconcile: reading the outbox tables")
            with engine.connect() as conn:
                bounds = queries.window_bounds(conn, schema, window)
                op_ids = queries.op_record_bounds(conn, schema, window)
                conn.rollback()
            log.info("window %s .. %s (%s): %d messages", _iso(window.since) or "beginning",
                     _iso(window.until), source, bounds.count)
            handed = _carried_in(spark, engine, schema, mark.output_path, window)
            jdbc = sources.jdbc_options(settings.database_url, settings.database_tcp_timeout)
            parts = sources.read_count(bounds.count, spark.sparkContext.defaultParallelism,
                                       settings.reconcile_partitions)
            ranges = sources.id_ranges(bounds.min_id or 0, bounds.max_id or 0, parts)
            own = sources.read_jdbc(
                spark, jdbc, [queries.message_facts(schema, window, r) for r in ranges])
            messages = _cache(cached, _with_carried(spark, jdbc, schema, window, own, handed))
            orphans = sources.read_jdbc(spark, jdbc, [
                queries.orphan_op_records(schema, window, r) for r in ranges] + [
                queries.outlying_orphan_op_records(
                    schema, window, r, (bounds.min_id or 0, bounds.max_id or 0))
                for r in sources.id_ranges(*(op_ids or (0, 0)), parts)])
            counted = messages.groupBy("carried", *findings.STATE).agg(
                F.count(F.lit(1)).alias("messages"),
                F.sum("op_records").alias("op_records")).collect()
            own_states = [r for r in counted if not r.carried]
            message_count = sum(r.messages for r in own_states)
            op_count = int(sum(r.op_records or 0 for r in own_states))
            carried_count = sum(r.messages for r in counted if r.carried)
        log.info("read %d messages, %d op records, %d carried over (%.1fs)", message_count,
                 op_count, carried_count, time.monotonic() - clock_start)

        records = read_to = unknown = judged = claims = kafka_count = None
        anchors, later, heads = handed.keys, handed.later, handed.heads
        recorded_since: set[int] = set()
        if settings.reconcile_read_topics:
            unread = _unread(mark, window)
            with _phase(timings, progress, "read topics"):
                records, plan = _read_topics(spark, settings, engine, messages, mark,
                                             window, unread, handed, cached)
                read_to = plan.read_to
                if not _re_audit(mark, window):  # which hands on the heads it was handed
                    heads = plan.heads
                anchors = _without_rewound(anchors, plan)
                kafka_count = records.count()
        inputs = findings.Inputs(messages, orphans, records, clock.now,
                                 settings.reconcile_sla_seconds, anchors)
        with _phase(timings, progress, "match"):
            spark.sparkContext.setJobDescription("outbox reconcile: matching the records")
            everything = findings.joined(inputs)
            facts = findings.facts(everything)
            if records is not None:
                everything = _cache(cached, everything)
                looked = findings.to_look_up(everything, facts).collect()
                unknown, judged, left = _outside(
                    spark, engine, jdbc, schema, findings.outside(everything),
                    [r for r in looked if r.topic is not None], window, plan, unread, cached)
                later = _later_from(spark, records, left)
                claims = _claims(spark, engine, schema, [
                    r.id for r in looked if r.several and r.delivered_ops > 0])
                recorded_since = _recorded_since(engine, schema, [
                    r.id for r in looked if r.unrecorded])

        output = _output_dir(output_root, started_at)
        with _phase(timings, progress, "find and write"):
            spark.sparkContext.setJobDescription("outbox reconcile: findings")
            # As many tasks as the messages were read in (one per core, more for a large
            # window), not the union of the findings' partitions: one per partition of each
            # input (32 for 60 messages with the topics read), each a task of its own in the
            # write and again in the count, with nothing to do in most of them. A session
            # that starts small (dynamic allocation) still gets one per read of a large window.
            found = _cache(cached, findings.find(inputs, facts, unknown, claims,
                                                 recorded_since, judged).coalesce(
                max(parts, spark.sparkContext.defaultParallelism)))
            found.write.mode("error").parquet(str(output / "findings"))
            counts, samples = _count(found, checked=[
                f.name for f in FINDINGS if records is not None or not f.needs_topics])
        log.info("findings: %s (%.1fs)", ", ".join(
            f"{name} {n}" for name, n in counts.items() if n) or "none",
            time.monotonic() - clock_start)
        with _phase(timings, progress, "carry over"):
            spark.sparkContext.setJobDescription("outbox reconcile: carrying over")
            carrying = carry.write(spark, output, facts, anchors, later, heads)
        with _phase(timings, progress, "statistics"):
            spark.sparkContext.setJobDescription("outbox reconcile: statistics")
            stats = findings.stats(own_states, messages.where(~F.col("carried")))

        exceeded = [name for name, n in counts.items()
                    if limits[name] is not None and n > limits[name]]  # type: ignore[operator]
        outcome = (RunOutcome.FAILED if exceeded
                   else RunOutcome.FINDINGS if any(counts.values()) else RunOutcome.CLEAN)
        # The files are written before the run's row commits: a disk that fills up leaves
        # neither a recorded run without its report nor a report of a run never recorded.
        with engine.begin() as conn:
            run_id = queries.record_run(conn, schema, {
                "started_at": started_at, "window_since": window.since,
                "window_until": window.until, "read_topics": records is not None,
                "kafka_offsets": _next_start(read_to, mark, window),
                "messages": message_count, "op_records": op_count,
                "kafka_records": kafka_count, "findings": counts, "outcome": outcome.value,
                "output_path": str(output),
            })
            summary = {
                "run_id": run_id,
                "outcome": outcome.value,
                "started_at": _iso(started_at),
                "seconds": round(time.monotonic() - clock_start, 3),
                "window": {"since": _iso(window.since), "until": _iso(window.until),
                           "requested_until": _iso(clock.requested_until), "source": source},
                "read_topics": records is not None,
                "sla_seconds": settings.reconcile_sla_seconds,
                "counts": {"messages": message_count, "op_records": op_count,
                           "kafka_records": kafka_count, "carried_in": carried_count,
                           "carried_out": carrying},
                "seconds_by_phase": timings,
                "findings": _findings_summary(counts, samples, limits, exceeded),
                "kafka_offsets": read_to,
                "stats": stats,
                "output_path": str(output),
            }
            text = report.render(summary)
            (output / "summary.json").write_text(
                json.dumps(summary, indent=2, default=str) + "\n")
            (output / "report.txt").write_text(text)
        recorded = True
        log.info("run %d %s in %.1fs: %s", run_id, outcome.value,
                 time.monotonic() - clock_start, output)
        return Result(run_id, outcome, window, counts, exceeded, output, summary, text)
    finally:
        if output is not None and not recorded:
            # no run reads a folder it did not record; half of one only misleads
            shutil.rmtree(output, ignore_errors=True)
            log.info("removed the unfinished run folder %s", output)
        for df in cached:
            df.unpersist()
        spark.sparkContext.setJobDescription(None)  # type: ignore[arg-type]


def _findings_summary(counts: dict[str, int], samples: dict[str, list[int]],
                      limits: dict[str, int | None], exceeded: list[str]
                      ) -> list[dict[str, Any]]:
    """Every finding, in a fixed order; those not checked (tables only) say so."""
    return [
        {"name": f.name, "title": f.title, "checked": f.name in counts,
         "count": counts.get(f.name, 0), "threshold": limits[f.name],
         "exceeded": f.name in exceeded, "sample_ids": samples.get(f.name, [])}
        for f in FINDINGS
    ]


def _require_past(since: datetime | None, until: datetime | None, now: datetime,
                  last_until: datetime | None) -> None:
    """A window given by hand lies in the past, starts before it ends, and not after the
    last run's end. A run's end is where the next run starts: one reaching into the future
    would leave every later run nothing to audit until then, and one starting after the
    last run's end would leave the time between to no run at all."""
    if since is not None and last_until is not None and since > last_until:
        raise ConfigurationError(
            f"--since {_iso(since)} is after the last run's end ({_iso(last_until)}): the "
            "messages of the time between would never be reconciled (the next run starts "
            "where this one ends); start at the last run's end or before")
    for name, value in (("--since", since), ("--until", until)):
        if value is not None and value > now:
            raise ConfigurationError(
                f"{name} {_iso(value)} is after the database's clock ({_iso(now)}): a window "
                "must lie in the past (the next run starts where this one ends)")
    if since is not None and until is not None and since >= until:
        raise ConfigurationError(f"--since {_iso(since)} is not before --until {_iso(until)}")


def _window(since: datetime | None, mark: queries.Watermark, clock: queries.Clock
            ) -> tuple[queries.Window, str]:
    """The window to reconcile, and where its start came from (for the report)."""
    if clock.until < clock.requested_until:
        log.warning("window end held back from %s to %s by a transaction still open",
                    _iso(clock.requested_until), _iso(clock.until))
    if since is not None:
        start, source = since, "--since"
    elif mark.until is not None:
        start, source = mark.until, "since the last run"
    else:
        start, source = None, "first run"
    if start is not None and start >= clock.until:
        log.info("nothing new: the window would end at %s, before it starts", _iso(clock.until))
        return queries.Window(start, start), source
    return queries.Window(start, clock.until), source


def _read_topics(spark: SparkSession, settings: ReconcileSettings, engine: Any, messages: DataFrame,
                 mark: queries.Watermark, window: queries.Window, unread: queries.Window | None,
                 handed: carry.Carry, cached: list[DataFrame]
                 ) -> tuple[DataFrame, sources.TopicPlan]:
    """The topics from the last run's end (or the window's first op record) to their end;
    after tables-only runs (``unread``) also the topics of their windows, and again from
    where the last topic run's records of later windows begin (``handed.later``). A
    partition recreated since the last topic run (``handed.heads``) is read from its start."""
    spark.sparkContext.setJobDescription("outbox reconcile: reading the topics")
    # one job for the three (a job costs about 0.3 s on a small window): the first recorded
    # position per partition, the messages delivered more than once, and the topics
    grouped = messages.groupBy(
        "topic", F.shiftright("op_at", queries.POSITION_OFFSET_BITS).alias("partition")).agg(
        F.min("op_at").alias("first"),
        F.collect_list(F.when(F.col("delivered_ops") > 1, F.col("id"))).alias("repeated"),
    ).collect()
    first_ops = {(r.topic, r.partition): r.first & ((1 << queries.POSITION_OFFSET_BITS) - 1)
                 for r in grouped if r.partition is not None}
    repeated = [message_id for r in grouped for message_id in r.repeated]
    topics = {r.topic for r in grouped} | set(mark.kafka_offsets or {})
    with engine.connect() as conn:
        for _, topic, partition, offset in queries.delivered_positions(
                conn, settings.schema_name, repeated):
            if partition is not None and offset is not None:
                key = (topic, partition)
                first_ops[key] = min(first_ops.get(key, offset), offset)
        unread_topics = set() if unread is None else queries.topics_of(
            conn, settings.schema_name, unread) - topics
        conn.rollback()
    if unread is not None:
        log.info("the runs since %s read the tables only: their windows' records are read "
                 "(again, from where the last topic run's records of later windows begin, in "
                 "%d partitions), and %d topics they alone saw%s",
                 _iso(unread.since) or "the beginning", len(handed.later), len(unread_topics),
                 f" ({', '.join(sorted(unread_topics))})" if 0 < len(unread_topics) <= 10
                 else "")
    topics |= unread_topics
    bounds = _log_bounds(settings, topics)
    plan = sources.plan_topics(bounds.ends, first_ops, mark.kafka_offsets,
                               window.since is None or (unread is not None
                                                        and mark.kafka_offsets is None),
                               handed.later if unread is not None else None,
                               bounds.heads, handed.heads)
    for topic, partition, seen, end in plan.rewound:
        if seen > end:
            log.warning("topic %s partition %d ends at offset %d, before offset %d where the "
                        "last run stopped reading: it was deleted and recreated, or Kafka lost "
                        "records. It is read from its start, all of it new, and the per-key "
                        "order of the topic's keys starts afresh", topic, partition, end, seen)
        else:
            log.warning("topic %s partition %d begins with another record (offset %d, written "
                        "at %s) than when the last run that read the topics saw it (offset %d, "
                        "%s): it was deleted and recreated. It is read from its start, all of "
                        "it new, and the per-key order of the topic's keys starts afresh",
                        topic, partition, *_head(bounds.heads[(topic, partition)]),
                        *_head(handed.heads[(topic, partition)]))
    log.info("reading %d offset ranges of %d topics (%d records) with %s", len(plan.ranges),
             len(topics), sum(r.end - r.start for r in plan.ranges), settings.kafka_client)
    client = settings.kafka_security(
        "librdkafka" if settings.kafka_client == "confluent" else "kafka-python")
    records = sources.read_topics(spark, settings.kafka_bootstrap, plan, client,
                                  library=settings.kafka_client)
    return _cache(cached, records), plan


def _next_start(read_to: dict[str, dict[str, int]] | None, mark: queries.Watermark,
                window: queries.Window) -> dict[str, dict[str, int]] | None:
    """Where the next topic run starts reading: where this one stopped, but for a re-audit
    of a window before the last run's end, which leaves the last topic run's offsets: it
    judged the records of its own window only, and those of the windows after it, which
    tables-only runs may have judged, are still to be compared."""
    return mark.kafka_offsets if read_to is not None and _re_audit(mark, window) else read_to


def _re_audit(mark: queries.Watermark, window: queries.Window) -> bool:
    """The window ends before the last run's: an older window audited again."""
    return mark.until is not None and window.until < mark.until


def _head(head: tuple[int, int]) -> tuple[int, str]:
    """A partition's first record as the log names it: its offset and its time."""
    offset, at = head
    return offset, datetime.fromtimestamp(at / 1000, UTC).isoformat(timespec="milliseconds")


def _unread(mark: queries.Watermark, window: queries.Window) -> queries.Window | None:
    """The windows that only tables-only runs judged, between the last run that read the
    topics (or the beginning) and this window: no run compared their messages' records with
    their op records. This run reads their topics too, new from where that run stopped (or
    from the topics' start), and again from where that run's records of later windows begin
    (carry.LATER)."""
    if mark.until is None or window.since is None or (
            mark.topics_until is not None and mark.topics_until >= window.since):
        return None
    return queries.Window(mark.topics_until, window.since)


def _without_rewound(anchors: DataFrame | None, plan: sources.TopicPlan) -> DataFrame | None:
    """The last run's last message per key, but for the topics whose offsets started again
    (their positions are of another log)."""
    rewound = sorted({topic for topic, *_ in plan.rewound})
    return anchors if anchors is None or not rewound else anchors.where(
        ~F.col("topic").isin(*rewound))


def _claims(spark: SparkSession, engine: Any, schema: str, ids: list[int]) -> DataFrame:
    """Each DELIVERED op record of the messages delivered or copied more than once (``ids``:
    those with a DELIVERED op record)."""
    with engine.connect() as conn:
        claims = queries.delivered_positions(conn, schema, ids)
        conn.rollback()
    return spark.createDataFrame(claims, "id long, topic string, partition int, offset long")


def _recorded_since(engine: Any, schema: str, ids: list[int]) -> set[int]:
    """Of the messages in Kafka without an op record in the tables as read (``ids``), those
    that have one now: delivered after the tables were read, before the topics were."""
    if not ids:
        return set()
    with engine.connect() as conn:
        recorded = {message_id for message_id, *_ in queries.delivered_positions(
            conn, schema, ids)}
        conn.rollback()
    if recorded:
        log.info("%d messages were delivered while the run read (in Kafka, not yet recorded "
                 "in the tables it read): no finding", len(recorded))
    return recorded


def _outside(spark: SparkSession, engine: Any, jdbc: dict[str, str], schema: str,
             outside: DataFrame, few: list[Any], window: queries.Window,
             plan: sources.TopicPlan, unread: queries.Window | None, cached: list[DataFrame]
             ) -> tuple[DataFrame, findings.Judged, DataFrame | None]:
    """Of the records outside the window (``outside``: new ones, ``fresh``, and ones read
    again to be checked, TopicPlan.recheck_from): the new ones whose outbox-id is no message
    of their topic at all (``unknown``), but for the messages retention pruned (no prepare
    row, an id below the ranges kept): nothing is left to judge them by; the messages of an
    earlier window with new copies, and those only tables-only runs judged (``unread``) with
    copies read again (``rechecked``), with their DELIVERED op records (``judged``;
    ``checked``: at or after where ``plan`` read their partition), so their copies are
    checked against them; and the new records of later windows' messages (``left``, None if
    there are none to look at): the runs that judge those windows compare them.

    ``few``: those records, if there are at most findings.DRIVER_LOOKUPS: their prepare rows
    and op records are looked up from the driver. Else Spark reads those of their id ranges
    (findings.id_buckets), as there may be millions."""
    if not few:
        return (spark.createDataFrame([], "topic string, outbox_id long"), findings.Judged(
            spark.createDataFrame([], "topic string, outbox_id long, rechecked boolean"),
            spark.createDataFrame(
                [], "id long, topic string, partition int, offset long, checked boolean")),
            None)
    many = len(few) > findings.DRIVER_LOOKUPS
    with engine.connect() as conn:
        kept_from = queries.pruned_below(conn, schema)
        if not many:
            ids = {r.id for r in few}
            outside = spark.createDataFrame([(r.topic, r.id, r.fresh) for r in few],
                                            "topic string, outbox_id long, fresh boolean")
            origins = spark.createDataFrame(
                queries.origins_of(conn, schema, ids, window, unread),
                "id long, topic string, earlier boolean, unread boolean")
            claims = spark.createDataFrame(queries.delivered_positions(conn, schema, ids),
                                           "id long, topic string, partition int, offset long")
        else:
            ranges = _id_ranges(findings.id_buckets(outside))
            origins = sources.read_jdbc(spark, jdbc, [
                queries.origins_between(schema, r, window, unread) for r in ranges])
            claims = sources.read_jdbc(spark, jdbc, [
                queries.delivered_between(schema, r) for r in ranges]).select(
                F.col("id").cast("long"), "topic", F.col("partition").cast("int"),
                F.col("offset").cast("long"))
        conn.rollback()
    found = outside.join(origins.select(
        F.col("id").alias("outbox_id"), F.col("topic").alias("origin"), "earlier", "unread"),
        "outbox_id", "left")
    if many:  # read once, used by three jobs
        found = _cache(cached, found)
    ours = F.coalesce(F.col("origin") == F.col("topic"), F.lit(False))
    pruned = (F.col("origin").isNull() & (F.col("outbox_id") < kept_from) if kept_from
              is not None else F.lit(False))
    rechecked = ~F.col("fresh") & ours & F.col("unread")
    messages = found.where((F.col("fresh") & ours & F.col("earlier")) | rechecked).select(
        "topic", "outbox_id", rechecked.alias("rechecked"))
    starts = spark.createDataFrame(
        [(t, p, o) for (t, p), o in plan.read_from().items()] or [("", -1, 0)],
        "topic string, partition int, read_from long")
    checked = (F.col("partition").isNull() | F.col("offset").isNull()
               | (F.col("offset") >= F.coalesce(F.col("read_from"), F.lit(0))))
    claims = claims.join(messages.select("topic", F.col("outbox_id").alias("id")),
                         ["topic", "id"], "left_semi").join(
        F.broadcast(starts), ["topic", "partition"], "left").select(
        "id", "topic", "partition", "offset", checked.alias("checked"))
    return (found.where(F.col("fresh") & ~ours & ~pruned).select("topic", "outbox_id"),
            findings.Judged(messages, claims, few=not many),
            found.where(F.col("fresh") & ours & ~F.col("earlier")).select("topic", "outbox_id"))


def _id_ranges(buckets: list[int], most: int = 1 << 20) -> list[tuple[int, int]]:
    """The message ids of ``buckets`` (ascending; findings.LOOKUP_BITS) as inclusive ranges,
    neighbours merged, each of at most ``most`` ids (a JDBC read each)."""
    ranges: list[tuple[int, int]] = []
    for bucket in buckets:
        low, high = bucket << findings.LOOKUP_BITS, ((bucket + 1) << findings.LOOKUP_BITS) - 1
        if ranges and ranges[-1][1] + 1 == low and high - ranges[-1][0] < most:
            ranges[-1] = (ranges[-1][0], high)
        else:
            ranges.append((low, high))
    return ranges


def _later_from(spark: SparkSession, records: DataFrame, left: DataFrame | None
                ) -> dict[tuple[str, int], int]:
    """Per (topic, partition), the lowest offset of the new records of ``left``'s messages
    (later windows'): handed on (carry.LATER) to the topic run after tables-only runs."""
    if left is None:
        return {}
    spark.sparkContext.setJobDescription("outbox reconcile: records of later windows")
    return {(r.topic, r.partition): r.offset for r in records.where("fresh").join(
        left, ["topic", "outbox_id"], "left_semi").groupBy(
        "topic", "partition").agg(F.min("offset").alias("offset")).collect()}


def _carried_in(spark: SparkSession, engine: Any, schema: str, previous_output: str | None,
                window: queries.Window) -> carry.Carry:
    """What the last run handed over; if it is gone, the messages before the window that the
    tables show were open at its end stand in for the ones it left open."""
    handed = carry.read(spark, previous_output)
    if not handed.missing or window.since is None:
        return handed
    with engine.connect() as conn:
        ids = queries.open_before(conn, schema, window.since)
        conn.rollback()
    log.warning("the last run left nothing to carry over at %s: judging again the %d messages "
                "before the window that the tables show still open, or settled since; per-key "
                "order starts afresh", previous_output, len(ids))
    return carry.Carry(ids, None)


def _with_carried(spark: SparkSession, jdbc: dict[str, str], schema: str,
                  window: queries.Window, own: DataFrame, handed: carry.Carry) -> DataFrame:
    """The window's messages and those the last run carried over, marked ``carried``."""
    messages = own.withColumn("carried", F.lit(False))
    ids = handed.open_ids
    if window.since is None or not ids:
        return messages
    carried = sources.read_jdbc(spark, jdbc, [
        queries.carried_facts(schema, window, ids[start:start + queries.LOOKUP_CHUNK])
        for start in range(0, len(ids), queries.LOOKUP_CHUNK)])
    return messages.unionByName(carried.withColumn("carried", F.lit(True)))


@contextlib.contextmanager
def _phase(timings: dict[str, float], progress: Progress, name: str) -> Iterator[None]:
    """Add the block's wall time to ``timings[name]`` (the summary's seconds_by_phase); the
    progress lines name the phase meanwhile."""
    start = time.monotonic()
    progress.phase = name
    try:
        yield
    finally:
        progress.phase = None
        timings[name] = round(timings.get(name, 0.0) + time.monotonic() - start, 3)


def _cache(cached: list[DataFrame], df: DataFrame) -> DataFrame:
    cached.append(df.cache())
    return df


def _count(found: DataFrame, checked: list[str]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Findings per name, and the lowest message ids of each for the report."""
    counts = dict.fromkeys(checked, 0)
    samples: dict[str, list[int]] = {}
    for row in found.groupBy("finding").agg(
        F.count(F.lit(1)).alias("n"),
        F.slice(F.sort_array(F.collect_set("message_id")), 1, SAMPLE_IDS).alias("ids"),
    ).collect():
        counts[row.finding] = row.n
        samples[row.finding] = list(row.ids)
    return counts, samples


def _output_root(settings: ReconcileSettings) -> Path:
    """``reconcile_output_dir``, made if missing, once a folder could be made in it; made
    absolute, as the run records it for the next (which may start in another folder)."""
    root = Path(settings.reconcile_output_dir).absolute()
    try:
        root.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".probe-", dir=root))
    except OSError as exc:
        raise ConfigurationError(
            f"cannot write the reconciliation's files under {root}: "
            f"{exc.strerror or exc}; set --output-dir or OUTBOX_RECONCILE_OUTPUT_DIR") from None
    return root


def _output_dir(root: Path, started_at: datetime) -> Path:
    """A new folder per run, named for when it started."""
    name = f"run-{started_at:%Y%m%dT%H%M%S}Z"
    for n in range(1, 1000):
        path = root / (name if n == 1 else f"{name}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise ConfigurationError(f"cannot create a run folder under {root}")


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.astimezone(UTC).isoformat().replace("+00:00", "Z")

