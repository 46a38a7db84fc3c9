"""The tests' proxies (tests/tcp_proxy.py, tests/kafka_proxy.py): a cut leaves no connection."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests import tcp_proxy
from tests.kafka_proxy import KafkaProxy
from tests.tcp_proxy import TcpProxy


@pytest.fixture
def target() -> Iterator[int]:
    """A port that accepts connections and never answers (the kernel's backlog accepts)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield server.getsockname()[1]


def closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("make", [TcpProxy, KafkaProxy], ids=["tcp", "kafka"])
def test_a_connection_being_made_when_the_proxy_is_cut_is_dropped_too(
    monkeypatch: pytest.MonkeyPatch, target: int, make: type[TcpProxy]
) -> None:
    """A client connecting while the proxy is cut used to outlive the cut: the proxy had
    checked it was open, then registered the pair after cut() had closed the registered
    ones (a producer's second connection, to the broker the metadata names, slipped
    through and test_transport's wait saw its records land while "cut")."""
    connecting, go_on = threading.Event(), threading.Event()
    connect = socket.create_connection

    def slow_connect(*args: Any, **kwargs: Any) -> socket.socket:
        connecting.set()
        go_on.wait(5)
        return connect(*args, **kwargs)

    monkeypatch.setattr(tcp_proxy.socket, "create_connection", slow_connect)
    proxy = make(target)
    client = socket.socket()
    try:
        client.connect(("127.0.0.1", proxy.port))
        assert connecting.wait(5)  # the proxy has let the client in and dials the target
        proxy.cut()
        go_on.set()
        assert closed_by_peer(client)
    finally:
        client.close()
        proxy.close()
