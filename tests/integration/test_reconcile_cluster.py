"""Reconciliation on a real Spark cluster (issue 15): ``spark-submit --master spark://...`` to a
standalone master and worker started from the installed pyspark distribution, the job's own
code shipped as a zip (``--py-files``) and the JDBC driver as a jar (``--jars``). The executors
run a Python that has the job's dependencies but not this package, so the run works only if
the shipping does. Its findings must equal the local run's on the same data.

A small cluster (one worker, one core, 1 GiB) because the test machines have two cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark
import pytest
from pyspark.sql import SparkSession
from sqlalchemy import Engine, text

import outbox
from outbox.dev import services as devservices
from outbox.settings import ReconcileSettings
from outbox.spark import reconcile as job
from tests.conftest import wait_until
from tests.integration import test_reconcile
from tests.wheel import build_wheel

pytestmark = pytest.mark.slow

SPARK_HOME = Path(pyspark.__file__).parent

#: test_reconcile.py's local session and its data set with one defect of each kind.
spark = test_reconcile.spark
defects = test_reconcile.defects
defect_run = test_reconcile.defect_run


@dataclass(frozen=True)
class Cluster:
    url: str
    ui_port: int

    def status(self) -> dict[str, Any]:
        """The master's state (its web UI's JSON view)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.load(r))

    def alive_workers(self) -> int:
        try:
            return int(self.status()["aliveworkers"])
        except (OSError, ValueError):  # not listening yet, or serving its start page
            return 0


def spark_env() -> dict[str, str]:
    return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}


def start_daemon(log: Path, main_class: str, *args: str) -> subprocess.Popen[bytes]:
    """A Spark daemon in a process group of its own (the worker's executors join it)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), main_class, *args],
            env={**spark_env(), "SPARK_DAEMON_MEMORY": "256m"}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


def stop_daemon(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A standalone master and one worker (1 core, 1 GiB) on free loopback ports."""
    work = tmp_path_factory.mktemp("spark-cluster")
    port, ui_port = devservices.free_port(), devservices.free_port()
    started = Cluster(f"spark://127.0.0.1:{port}", ui_port)
    daemons = [start_daemon(work / "master.log", "org.apache.spark.deploy.master.Master",
                            "--host", "127.0.0.1", "--port", str(port),
                            "--webui-port", str(ui_port))]
    try:
        daemons.append(start_daemon(
            work / "worker.log", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
            "--cores", "1", "--memory", "1g", "--webui-port", str(devservices.free_port()),
            "--work-dir", str(work / "worker"), started.url))
        wait_until(lambda: started.alive_workers() == 1, 120, "the worker to join the master")
        yield started
    finally:
        for daemon in reversed(daemons):
            stop_daemon(daemon)


@pytest.fixture(scope="module")
def package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The job's own code as it is shipped: the project's wheel, named ``.zip`` (PySpark puts
    only .zip, .egg and .jar files of ``--py-files`` on the executors' Python path)."""
    folder = tmp_path_factory.mktemp("package")
    return build_wheel(folder).rename(folder / "transactional_outbox.zip")


@pytest.fixture(scope="module")
def node_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Python like a cluster node's: the job's dependencies, but not this package."""
    venv = tmp_path_factory.mktemp("node") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    site = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True)
    # Our site-packages as a plain path: its packages, but not its .pth files (one of which
    # is the editable install of outbox).
    (Path(site.strip()) / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    probe = subprocess.run([python, "-c", "import pyarrow, kafka, sqlalchemy; import outbox"],
                           cwd=venv, capture_output=True, text=True, timeout=60)
    assert "No module named 'outbox'" in probe.stderr, probe.stderr
    return python


def spark_submit(cluster: Cluster, package: Path, node_python: str, env: dict[str, str],
                 cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``outbox reconcile ARGS`` through spark-submit, as docs/operations.md describes (from
    ``cwd``: not the checkout, whose outbox/ folder Python would import from there)."""
    return subprocess.run([
        str(SPARK_HOME / "bin" / "spark-submit"), "--master", cluster.url,
        "--py-files", str(package), "--jars", ReconcileSettings().reconcile_jdbc_jar,
        "--conf", f"spark.pyspark.python={node_python}",
        "--conf", f"spark.pyspark.driver.python={sys.executable}",
        "--driver-memory", "1g", "--executor-memory", "512m",
        "--conf", "spark.sql.shuffle.partitions=4", "--conf", "spark.ui.enabled=false",
        str(Path(outbox.__file__).with_name("__main__.py")), "reconcile", *args,
    ], env={**spark_env(), **env}, cwd=cwd, capture_output=True, text=True, timeout=600)


def findings_by_name(spark: SparkSession, run_dir: Path) -> dict[str, set[int | None]]:
    ids: dict[str, set[int | None]] = {}
    for row in spark.read.parquet(str(run_dir / "findings")).collect():
        ids.setdefault(row.finding, set()).add(row.message_id)
    return ids


def test_spark_submit_to_a_standalone_cluster_finds_what_the_local_run_finds(
    spark: SparkSession, engine: Engine, defects: test_reconcile.Defects,
    defect_run: job.Result, cluster: Cluster, package: Path, node_python: str, tmp_path: Path
) -> None:
    settings = defects.settings
    with engine.begin() as conn:  # the cluster run starts from where the local run did
        conn.execute(text(f"DELETE FROM {settings.schema_name}.reconcile_run"))

    submitted = spark_submit(
        cluster, package, node_python,
        {"OUTBOX_DATABASE_URL": settings.database_url, "OUTBOX_SCHEMA": settings.schema_name,
         "OUTBOX_KAFKA_BOOTSTRAP": settings.kafka_bootstrap}, tmp_path,
        "--read-topics", "--until", defect_run.window.until.isoformat(),
        "--sla-seconds", str(settings.reconcile_sla_seconds),
        "--partitions", str(settings.reconcile_partitions), "--output-dir", str(tmp_path / "out"))

    assert submitted.returncode == defect_run.exit_code == 1, submitted.stderr[-5000:]
    (run_dir,) = (tmp_path / "out").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {part: summary["window"][part] for part in ("since", "until", "source")} == {
        part: defect_run.summary["window"][part] for part in ("since", "until", "source")}
    assert summary["counts"] == defect_run.summary["counts"]
    assert summary["findings"] == defect_run.summary["findings"]
    assert findings_by_name(spark, run_dir) == findings_by_name(spark, defect_run.output_path)
    wait_until(lambda: len(cluster.status()["completedapps"]) == 1, 30, "the app to complete")
    (app,) = cluster.status()["completedapps"]
    assert app["name"] == "outbox-reconcile" and app["cores"] == 1
