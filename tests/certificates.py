"""A throwaway certificate authority and a server certificate for 127.0.0.1, made with the
``openssl`` command at test time (installed by scripts/bootstrap.sh)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certificates:
    ca: Path
    server_cert: Path
    server_key: Path


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def make_certificates(folder: Path) -> Certificates:
    """A CA and a certificate it signed for 127.0.0.1 and localhost, valid for a day."""
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "1", "-subj", "/CN=outbox test CA")
    _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
             "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(folder, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")
    return Certificates(folder / "ca.pem", folder / "server.pem", folder / "server.key")
