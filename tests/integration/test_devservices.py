"""`outbox dev up` starts reachable services and `outbox dev down` stops exactly those."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from kafka import KafkaProducer

from outbox import migrate
from outbox.dev import services as devservices
from outbox.dev.services import Services
from tests.conftest import wait_until
from tests.processes import alive, run_outbox


def test_dev_up_prints_settings_and_dev_down_stops_everything(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    up = run_outbox(None, "dev", "up", "--state-file", str(state))
    assert up.returncode == 0, up.stderr
    exported = dict(
        line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()
    )
    assert set(exported) == {"OUTBOX_DATABASE_URL", "OUTBOX_KAFKA_BOOTSTRAP"}
    services = Services.load(state)
    try:
        with psycopg.connect(exported["OUTBOX_DATABASE_URL"]) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        producer = KafkaProducer(bootstrap_servers=exported["OUTBOX_KAFKA_BOOTSTRAP"])
        producer.send("dev-check", b"x").get(timeout=10)
        producer.close()
        again = run_outbox(None, "dev", "up", "--state-file", str(state))
        assert (again.returncode, again.stderr.strip()) == (2, (
            f"outbox: error: services already recorded in {state}: `outbox dev env` prints "
            "their settings again, `outbox dev down` stops them"))
        shown = run_outbox(None, "dev", "env", "--state-file", str(state))
        assert (shown.returncode, shown.stdout) == (0, up.stdout), "for another shell"
        assert services.root not in devservices.reap_orphans(), "kept until dev down"
    finally:
        down = run_outbox(None, "dev", "down", "--state-file", str(state))
    assert (down.returncode, down.stderr) == (
        0, "stopped the embedded PostgreSQL and Kafka broker\n")
    assert not state.exists()
    assert run_outbox(None, "dev", "env", "--state-file", str(state)).returncode == 2
    assert not os.path.exists(services.root)
    assert not alive(services.tansu_pid), "the broker process is gone"


def test_dev_up_starts_again_on_their_ports_the_recorded_servers_that_were_killed(
    tmp_path: Path
) -> None:
    """A broker killed (or PostgreSQL): `dev up` refused ("services already recorded"), and
    `dev down` then discarded the database with it."""
    state = tmp_path / "state.json"
    up = run_outbox(None, "dev", "up", "--state-file", str(state))
    assert up.returncode == 0, up.stderr
    services = Services.load(state)
    try:
        with psycopg.connect(services.database_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (id int)")
            conn.execute("CHECKPOINT")  # --fast commits without waiting for the WAL's flush
        postmaster = int(Path(services.pg_data, "postmaster.pid").read_text().split()[0])
        for pid in (services.tansu_pid, postmaster):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len(devservices.not_running(services)) == 2, 10, "both gone")

        shown = run_outbox(None, "dev", "env", "--state-file", str(state))
        assert (shown.returncode, shown.stdout) == (0, up.stdout)
        assert shown.stderr.splitlines() == [
            f"# the embedded {name} recorded there is not running: `outbox dev up` starts it "
            "again" for name in ("PostgreSQL", "Kafka broker")]
        again = run_outbox(None, "dev", "up", "--state-file", str(state))
        assert (again.returncode, again.stdout) == (0, up.stdout), again.stderr
        assert again.stderr.startswith(
            f"# restarted the embedded PostgreSQL and Kafka broker recorded in {state}; the "
            "broker's topics were in memory and are gone\n")
        with psycopg.connect(services.database_url) as conn:
            assert conn.execute("SELECT count(*) FROM kept").fetchone() == (0,)
        producer = KafkaProducer(bootstrap_servers=services.kafka_bootstrap)
        producer.send("dev-check", b"x").get(timeout=10)
        producer.close()
        assert devservices.not_running(Services.load(state)) == []
    finally:
        down = run_outbox(None, "dev", "down", "--state-file", str(state))
    assert (down.returncode, down.stderr) == (
        0, "stopped the embedded PostgreSQL and Kafka broker\n")


def test_dev_up_starts_new_services_when_the_recorded_ones_are_gone_with_their_folder(
    tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    Services(root=str(tmp_path / "gone"), pg_bindir="/nonexistent", pg_port=1, kafka_port=1,
             tansu_pid=0).save(state)
    up = run_outbox(None, "dev", "up", "--state-file", str(state))
    try:
        assert up.returncode == 0, up.stderr
        assert up.stderr.startswith(f"# the services recorded in {state} are gone with their "
                                    f"folder {tmp_path / 'gone'}: starting new ones\n")
        assert Services.load(state).exists()
    finally:
        assert run_outbox(None, "dev", "down", "--state-file", str(state)).returncode == 0


def test_the_next_start_stops_what_a_killed_process_left_running(services: Services) -> None:
    """A test run or demo killed with -9 cannot stop its servers; the next start does."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom outbox.dev import services as s\n"
         "started = s.start()\nprint(started.root, started.tansu_pid, flush=True)\n"
         "time.sleep(600)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    root, tansu = child.stdout.readline().split()
    postmaster = int(Path(root, "pgdata", "postmaster.pid").read_text().split()[0])
    child.kill()
    child.wait()
    assert alive(postmaster) and alive(int(tansu)), "orphaned"

    reaped = devservices.reap_orphans()
    assert root in reaped
    assert services.root not in reaped, "the services of a live process stay"
    assert not alive(postmaster) and not alive(int(tansu))
    assert not os.path.exists(root)


def test_application_tables_land_in_public_as_in_production(services: Services) -> None:
    """The dev user is not named like the outbox schema, so the default search_path
    ("$user", public) never puts an application's tables among the outbox's."""
    database = f"app_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(services.database_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {database}")
    url = services.database_url.rsplit("/", 1)[0] + f"/{database}"
    migrate.upgrade(url, "outbox")
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE orders (id int)")
        assert conn.execute("SELECT to_regclass('orders')::text").fetchone() == (
            "orders",)
        where = conn.execute("SELECT relnamespace::regnamespace::text FROM pg_class "
                             "WHERE relname = 'orders'").fetchone()
    assert where == ("public",)


def test_dev_down_signals_no_process_but_the_broker_it_started(tmp_path: Path) -> None:
    """The broker gone, its recorded pid may be another process's by now: `dev down` sent it
    SIGTERM, then waited on it."""
    stranger = subprocess.Popen(["sleep", "60"])
    state = tmp_path / "state.json"
    try:
        Services(root=str(tmp_path / "gone"), pg_bindir="/nonexistent", pg_port=1, kafka_port=1,
                 tansu_pid=stranger.pid).save(state)
        down = run_outbox(None, "dev", "down", "--state-file", str(state))
        assert down.returncode == 0, down.stderr
        assert stranger.poll() is None, "an unrelated process was signalled"
        assert down.stderr == (f"nothing recorded in {state} was running (stopped by a reboot "
                               "or a kill); forgot it\n"), "not 'stopped ...'"
        assert not state.exists()
    finally:
        stranger.kill()
        stranger.wait()


def test_a_state_file_dev_up_did_not_write_is_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    for text in ('{"root": "/tmp/x"}', "not json"):
        state.write_text(text)
        for command in ("down", "env"):
            result = run_outbox(None, "dev", command, "--state-file", str(state))
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            assert f"{state} is not a state file `outbox dev up` wrote" in result.stderr


def users_of(folder: Path) -> set[int]:
    """The processes whose command line or open files name ``folder`` (PostgreSQL's name
    its data directory, the broker holds its log there)."""
    found = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            named = [proc.joinpath("cmdline").read_bytes().decode(errors="replace")]
            named += [os.readlink(fd) for fd in proc.joinpath("fd").iterdir()]
        except OSError:
            continue
        if any(str(folder) in name for name in named):
            found.add(int(proc.name))
    return found


@contextlib.contextmanager
def own_temporary_folder() -> Iterator[Path]:
    """A TMPDIR for `outbox dev up` (its services' folders land there), traversable by the
    postgres user; whatever a failing test leaves in it is killed and removed."""
    folder = Path(tempfile.mkdtemp(prefix="outbox-devtest-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for pid in users_of(folder):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_dev_up_stopped_while_it_starts_leaves_nothing_running(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """SIGTERM or SIGHUP while `dev up` started PostgreSQL killed it and left the server
    running, recorded nowhere (no state file, no owner to reap it by), its folder kept;
    Ctrl-C stopped them but said only 'Aborted!' with exit code 1."""
    state = tmp_path / "state.json"
    with own_temporary_folder() as temporary:
        up = subprocess.Popen([sys.executable, "-m", "outbox", "dev", "up", "--state-file",
                               str(state)], env={**os.environ, "TMPDIR": str(temporary)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_until(lambda: any(temporary.glob("*/postgres.log")), 30,
                   "PostgreSQL starting")
        up.send_signal(signum)
        _, stderr = up.communicate(timeout=30)

        assert (up.returncode, stderr) == (128 + signum, (
            f"outbox: error: dev up was stopped ({signum.name}) while it started the "
            "services: it stopped them again and removed their folder\n"))
        assert users_of(temporary) == set(), "left running"
        assert list(temporary.iterdir()) == [], "their folder"
        assert not state.exists()


def test_dev_up_whose_state_file_does_not_fit_leaves_nothing_running(
    tmp_path: Path, small_disk: Path
) -> None:
    """A full disk under the state file gave a traceback, an empty state file (so `dev down`
    could not stop them) and both servers running, recorded nowhere."""
    (small_disk / "filler").write_bytes(bytes(64 * 1024))
    state = small_disk / "state.json"
    with own_temporary_folder() as temporary:
        up = run_outbox(None, "dev", "up", "--state-file", str(state),
                        env={**os.environ, "TMPDIR": str(temporary)})

        assert (up.returncode, up.stdout, up.stderr) == (2, "", (
            f"outbox: error: cannot record the services in {state} (No space left on "
            "device): stopped them again; free some room there or give another "
            "--state-file\n"))
        assert users_of(temporary) == set(), "left running"
        assert list(temporary.iterdir()) == [], "their folder"
        assert not state.exists(), "an empty state file"


def test_dev_up_that_cannot_record_the_servers_it_started_again_stops_them(
    small_disk: Path
) -> None:
    """Servers killed, then the disk of the state file full: `dev up` started them again and
    gave a traceback, the state file naming a broker pid that was no longer it (so `dev
    down` left the new broker running)."""
    state = small_disk / "state.json"
    with own_temporary_folder() as temporary:
        env = {**os.environ, "TMPDIR": str(temporary)}
        assert run_outbox(None, "dev", "up", "--state-file", str(state), env=env
                          ).returncode == 0
        services = Services.load(state)
        postmaster = int(Path(services.pg_data, "postmaster.pid").read_text().split()[0])
        for pid in (services.tansu_pid, postmaster):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len(devservices.not_running(services)) == 2, 10, "both gone")
        room = os.statvfs(small_disk)
        (small_disk / "filler").write_bytes(bytes(room.f_bavail * room.f_frsize))

        full = run_outbox(None, "dev", "up", "--state-file", str(state), env=env)

        assert (full.returncode, full.stdout, full.stderr) == (2, "", (
            f"outbox: error: cannot record the services in {state} (No space left on "
            "device): stopped the PostgreSQL and Kafka broker again (PostgreSQL's data is "
            "kept); free some room there and run `outbox dev up` again\n"))
        assert users_of(temporary) == set(), "left running"
        assert Services.load(state) == services, "the record as it was"
        (small_disk / "filler").unlink()
        again = run_outbox(None, "dev", "up", "--state-file", str(state), env=env)
        assert again.returncode == 0, again.stderr
        down = run_outbox(None, "dev", "down", "--state-file", str(state), env=env)
        assert (down.returncode, down.stderr) == (
            0, "stopped the embedded PostgreSQL and Kafka broker\n")
        assert users_of(temporary) == set(), "left running"


def test_dev_up_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path: Path) -> None:
    """initdb's two lines (its error, then 'removing data directory') ended the command: the
    error line was cut in two."""
    state = tmp_path / "state.json"
    with own_temporary_folder() as temporary:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=755", "tmpfs",
                        str(temporary)], check=True)
        try:
            (temporary / "filler").write_bytes(bytes(40 * 1024))  # room for a folder, no more
            up = run_outbox(None, "dev", "up", "--state-file", str(state),
                            env={**os.environ, "TMPDIR": str(temporary)})
            left = sorted(path.name for path in temporary.iterdir())
        finally:
            subprocess.run(["umount", str(temporary)], check=True)
    assert up.returncode == 2, up.stderr
    assert len(up.stderr.splitlines()) == 1, up.stderr
    assert up.stderr.startswith("outbox: error: initdb failed: initdb: error: could not "), \
        up.stderr
    assert "No space left on device" in up.stderr
    assert left == ["filler"]
    assert not state.exists()


@pytest.mark.parametrize("command", ["up", "env", "down"])
def test_a_state_file_that_is_a_folder_is_a_usage_error(tmp_path: Path, command: str) -> None:
    """It was a traceback (IsADirectoryError) and exit code 1; `dev up` with it started
    nothing, `dev down` stopped nothing."""
    result = run_outbox(None, "dev", command, "--state-file", str(tmp_path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert (f"Error: Invalid value for '--state-file': File '{tmp_path}' is a directory."
            in result.stderr), result.stderr


def test_dev_up_stopped_while_it_starts_killed_servers_again_stops_them_again(
    tmp_path: Path
) -> None:
    """Stopped while it started again PostgreSQL, it left it running and, had it reached the
    broker, a broker recorded nowhere (the state file names the old one's pid)."""
    state = tmp_path / "state.json"
    with own_temporary_folder() as temporary:
        env = {**os.environ, "TMPDIR": str(temporary)}
        assert run_outbox(None, "dev", "up", "--state-file", str(state), env=env
                          ).returncode == 0
        services = Services.load(state)
        pid_file = Path(services.pg_data, "postmaster.pid")
        postmaster = int(pid_file.read_text().split()[0])
        for pid in (services.tansu_pid, postmaster):
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len(devservices.not_running(services)) == 2, 10, "both gone")
        pid_file.unlink()

        up = subprocess.Popen([sys.executable, "-m", "outbox", "dev", "up", "--state-file",
                               str(state)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        wait_until(pid_file.exists, 30, "PostgreSQL starting again")
        up.send_signal(signal.SIGTERM)
        _, stderr = up.communicate(timeout=30)

        assert (up.returncode, stderr) == (143, (
            f"outbox: error: dev up was stopped (SIGTERM) while it started again the services "
            f"recorded in {state}: it stopped those again (PostgreSQL's data is kept); `outbox "
            "dev up` starts them\n"))
        assert users_of(temporary) == set(), "left running"
        assert Services.load(state) == services
        again = run_outbox(None, "dev", "up", "--state-file", str(state), env=env)
        assert again.returncode == 0, again.stderr
        assert run_outbox(None, "dev", "down", "--state-file", str(state), env=env
                          ).returncode == 0
