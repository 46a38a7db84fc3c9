"""A Kafka-protocol-aware loopback proxy that makes chosen topics missing, for real.

Tansu creates a topic whenever a client asks for its metadata, so a missing topic (Apache
Kafka with ``auto.create.topics.enable=false``, the production norm) cannot be had from it
directly. This proxy forwards every request and response unchanged except Metadata (api
key 3): held topics are taken out of the request (the broker never hears of them, so it does
not create them) and put back into the response with UNKNOWN_TOPIC_OR_PARTITION, exactly what
Apache Kafka answers; and the brokers listed are rewritten to the proxy, so clients keep
talking through it. :meth:`KafkaProxy.release` makes a held topic appear (the broker then
creates it on demand). Frames are decoded with kafka-python's protocol classes, which know
every Metadata version, flexible ones included, so kafka-python and librdkafka both work.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import uuid
from typing import Any

from kafka.protocol.metadata import MetadataRequest, MetadataResponse

from outbox.dev.services import free_port

METADATA = 3
UNKNOWN_TOPIC_OR_PARTITION = 3


class KafkaProxy:
    def __init__(self, target_port: int, held: set[str] | None = None) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._held = set(held or ())
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.settimeout(0.1)
        threading.Thread(target=self._accept, daemon=True, name="kafka-proxy").start()

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def hold(self, topic: str) -> None:
        with self._lock:
            self._held.add(topic)

    def release(self, topic: str) -> None:
        """The topic exists from now on (the broker creates it when asked for it)."""
        with self._lock:
            self._held.discard(topic)

    def held(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._held)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(("127.0.0.1", self.target_port), 2)
            except (TimeoutError, OSError):
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._sockets += [client, upstream]
            #: correlation id -> (api key, api version, held topics it asked for)
            asked: dict[int, tuple[int, int, frozenset[str]]] = {}
            threading.Thread(target=self._pump, args=(client, upstream, self._request, asked),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self._response, asked),
                             daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, rewrite: Any,
              asked: dict[int, tuple[int, int, frozenset[str]]]) -> None:
        try:
            while True:
                size = struct.unpack(">i", _read(source, 4))[0]
                sink.sendall(rewrite(_read(source, size), asked))
        except (OSError, ConnectionError, struct.error):
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()

    def _request(self, body: bytes, asked: dict[int, tuple[int, int, frozenset[str]]]
                 ) -> bytes:
        api_key, version, correlation_id = struct.unpack(">hhi", body[:8])
        held: frozenset[str] = frozenset()
        if api_key == METADATA:
            request = MetadataRequest.decode(body, version=version, header=True)
            if request.topics:
                held = self.held() & {t.name for t in request.topics}
                if held:
                    request.topics = [t for t in request.topics if t.name not in held]
                    body = bytes(request.encode(header=True))
        asked[correlation_id] = (api_key, version, held)
        return _framed(body)

    def _response(self, body: bytes, asked: dict[int, tuple[int, int, frozenset[str]]]
                  ) -> bytes:
        correlation_id = struct.unpack(">i", body[:4])[0]
        api_key, version, held = asked.pop(correlation_id, (-1, -1, frozenset()))
        if api_key != METADATA:
            return _framed(body)
        response = MetadataResponse.decode(body, version=version, header=True)
        for broker in response.brokers:
            broker.host, broker.port = "127.0.0.1", self.port
        hidden = held | self.held()  # an all-topics request must not list a held topic
        response.topics = [t for t in response.topics if t.name not in hidden] + [
            MetadataResponse.MetadataResponseTopic(
                error_code=UNKNOWN_TOPIC_OR_PARTITION, name=name, topic_id=uuid.UUID(int=0),
                is_internal=False, partitions=[], version=version)
            for name in sorted(held)]
        return bytes(response.encode(header=True, framed=True))


def _read(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = sock.recv(size - len(chunks))
        if not chunk:
            raise ConnectionError("closed")
        chunks += chunk
    return bytes(chunks)


def _framed(body: bytes) -> bytes:
    return struct.pack(">i", len(body)) + body
