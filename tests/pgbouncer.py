"""A PgBouncer in front of the test session's PostgreSQL, in transaction or session mode."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from sqlalchemy import make_url

from outbox.dev import services as devservices


@contextlib.contextmanager
def pgbouncer(database_url: str, pool_mode: str) -> Iterator[str]:
    """PgBouncer pooling ``database_url``'s database in ``pool_mode``; yields its URL (the
    same user and password; PgBouncer trusts its clients and logs in with them)."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    url = make_url(database_url)
    port = devservices.free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    folder.chmod(0o777)  # it runs as postgres, never as root (it refuses)
    (folder / "users.txt").write_text(f'"{url.username}" ""\n')
    (folder / "pgbouncer.ini").write_text(
        f"[databases]\n{url.database} = host={url.host} port={url.port} dbname={url.database} "
        f"user={url.username} password={url.password}\n"
        f"[pgbouncer]\nlisten_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n"
        f"auth_type = trust\nauth_file = {folder / 'users.txt'}\npool_mode = {pool_mode}\n"
        f"default_pool_size = 10\nmax_client_conn = 100\nlogfile = {folder / 'log'}\n")
    as_postgres = (["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]
                   if os.geteuid() == 0 else [])
    process = subprocess.Popen([*as_postgres, binary, str(folder / "pgbouncer.ini")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pooled = database_url.replace(f"@{url.host}:{url.port}/", f"@127.0.0.1:{port}/")
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                psycopg.connect(pooled, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if process.poll() is not None or time.monotonic() > deadline:
                    said = process.stderr.read() if process.stderr else b""
                    raise RuntimeError(f"pgbouncer did not start: {said!r}") from None
                time.sleep(0.1)
        yield pooled
    finally:
        process.terminate()
        process.wait(10)
        shutil.rmtree(folder, ignore_errors=True)
