"""A Spark cluster for the reconciliation's cluster test (issue 15, in test_reconcile.py):
a standalone master and worker started from the installed pyspark distribution, the job's own
code shipped as a zip (``--py-files``) and the JDBC driver as a jar (``--jars``). The executors
run a Python that has the job's dependencies but not this package, so a run works only if the
shipping does.

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
from pyspark.sql import SparkSession

import outbox
from outbox.dev import services as devservices
from outbox.settings import ReconcileSettings
from tests.conftest import wait_until
from tests.wheel import build_wheel

SPARK_HOME = Path(pyspark.__file__).parent

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


#: The JIT's first tier and the serial collector, as tests/spark-conf gives drivers and
#: executors: the daemons live for one test.
SMALL_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def spark_env() -> dict[str, str]:
    return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}


def start_daemon(log: Path, main_class: str, *args: str) -> subprocess.Popen[bytes]:
    """A Spark daemon in a process group of its own (the worker's executors join it)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), main_class, *args],
            env={**spark_env(), "SPARK_DAEMON_MEMORY": "256m",
                 "SPARK_DAEMON_JAVA_OPTS": SMALL_JVM}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True)


def stop_daemon(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)


@contextlib.contextmanager
def standalone(work: Path) -> Iterator[Cluster]:
    """A standalone master and one worker (1 core, 1 GiB) on free loopback ports, logging
    and working in ``work``."""
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


def package(folder: Path) -> Path:
    """The job's own code as it is shipped: the project's wheel, named ``.zip`` (PySpark puts
    only .zip, .egg and .jar files of ``--py-files`` on the executors' Python path)."""
    return build_wheel(folder).rename(folder / "transactional_outbox.zip")


def node_python(folder: Path) -> str:
    """A Python like a cluster node's (a venv in ``folder``): the job's dependencies, but not
    this package."""
    venv = folder / "venv"
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
