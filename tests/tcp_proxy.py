"""A loopback TCP proxy whose connections the tests can cut, to take the broker away; given a
TLS context it also terminates TLS, so clients speak TLS to a broker that cannot."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading

from outbox.dev.services import free_port


class TcpProxy:
    def __init__(self, target_port: int, port: int | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self.target_port = target_port
        self.tls = tls
        self.port = port or free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener.settimeout(0.1)
        self._open = threading.Event()
        self._open.set()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        #: bytes that, sent by a client, cut its connection instead of reaching the server
        self._trap: bytes | None = None
        #: set once the trap has cut a connection
        self.sprung = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="proxy-accept").start()

    def cut(self) -> None:
        """Drop every connection and refuse new ones until :meth:`restore`."""
        self._open.clear()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a pump blocked in recv()
            sock.close()

    def client_ports(self) -> list[int]:
        """The clients' own ports of the connections open now."""
        ports = []
        with self._lock:
            for client in self._sockets[::2]:  # (client, upstream) pairs
                with contextlib.suppress(OSError):
                    ports.append(client.getpeername()[1])
        return ports

    def trap(self, pattern: bytes) -> None:
        """Cut the next connection whose client sends ``pattern``, before the server gets it
        (a connection lost at one chosen statement); then pass everything again."""
        self.sprung.clear()
        self._trap = pattern

    def restore(self) -> None:
        self._open.set()

    def close(self) -> None:
        self._closed.set()
        self.cut()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            if not self._open.is_set():
                client.close()
                continue
            if self.tls is not None:
                try:
                    client.settimeout(5)
                    client = self.tls.wrap_socket(client, server_side=True)
                except OSError:  # not a TLS client (ssl.SSLError is an OSError)
                    client.close()
                    continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), 2)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if not self._open.is_set():  # cut while connecting: cut() never saw this pair
                    client.close()
                    upstream.close()
                    continue
                self._sockets += [client, upstream]
            self._serve(client, upstream)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        """Pass bytes both ways until either side closes."""
        threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        try:
            while True:
                readable, _, _ = select.select([a, b], [], [], 0.5)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    while isinstance(sock, ssl.SSLSocket) and sock.pending():
                        data += sock.recv(sock.pending())
                    if sock is a and self._trap is not None and self._trap in data:
                        self._trap = None
                        self.sprung.set()
                        return
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (a, b):
                with contextlib.suppress(OSError):
                    sock.close()
