"""Connections silenced by the kernel, as a network that lost them without a reset would
(a NAT entry dropped, a host powered off): the packets of chosen client ports to a local
port are dropped by iptables, so those clients see neither an error nor an answer, while
new connections (other ports) pass. Needs root and iptables (scripts/bootstrap.sh). And a
server that takes connections and never answers (:func:`mute_server`), which needs neither."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def silenced(port: int, client_ports: list[int]) -> Iterator[None]:
    with _dropped([["INPUT", "-p", "tcp", "-s", "127.0.0.1", "--sport", str(client),
                    "--dport", str(port), "-j", "DROP"] for client in client_ports]):
        yield


@contextlib.contextmanager
def unanswered_connects(port: int) -> Iterator[None]:
    """New connections to ``port`` vanish (their SYN dropped, as by a firewall or a server
    whose backlog is full); the open ones go on."""
    with _dropped([["INPUT", "-p", "tcp", "-s", "127.0.0.1", "--dport", str(port), "--syn",
                    "-j", "DROP"]]):
        yield


@contextlib.contextmanager
def cut_off(port: int, user: str) -> Iterator[None]:
    """The packets ``user``'s processes send to ``port`` vanish, open connections and new
    ones alike (a network cut between one host and a service); other users' pass."""
    with _dropped([["OUTPUT", "-p", "tcp", "--dport", str(port), "-m", "owner",
                    "--uid-owner", user, "-j", "DROP"]]):
        yield


@contextlib.contextmanager
def _dropped(rules: list[list[str]]) -> Iterator[None]:
    added: list[list[str]] = []
    try:
        for rule in rules:
            subprocess.run(["iptables", "-w", "-I", *rule], check=True, capture_output=True)
            added.append(rule)
        yield
    finally:
        for rule in added:
            subprocess.run(["iptables", "-w", "-D", *rule], check=False, capture_output=True)


@contextlib.contextmanager
def mute_server() -> Iterator[tuple[int, list[socket.socket]]]:
    """A local port whose server takes each connection and never says a word (a database
    host whose process hangs): yields the port and the connections taken so far."""
    taken: list[socket.socket] = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(0.2)
        done = threading.Event()

        def accept() -> None:
            while not done.is_set():
                with contextlib.suppress(TimeoutError):
                    taken.append(listener.accept()[0])

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield listener.getsockname()[1], taken
        finally:
            done.set()
            thread.join()
            for connection in taken:
                connection.close()
