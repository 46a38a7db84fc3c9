"""A Kafka-protocol-aware loopback proxy (a TcpProxy, so it can be cut too) that makes chosen
topics missing, for real.

Tansu creates a topic whenever a client asks for its metadata (it ignores Metadata's
``allow_auto_topic_creation=false``), so a missing topic (Apache Kafka with
``auto.create.topics.enable=false``, the production norm) cannot be had from it directly.
This proxy forwards every request and response unchanged except:

* Metadata (api key 3): held topics are taken out of the request (the broker never hears of
  them, so it does not create them) and put back into the response with
  UNKNOWN_TOPIC_OR_PARTITION, exactly what Apache Kafka answers (or, after
  :meth:`KafkaProxy.deny_describe`, TOPIC_AUTHORIZATION_FAILED: what it answers a principal
  without the topic's Describe ACL); the brokers listed are rewritten to the proxy, so clients
  keep talking through it. :meth:`KafkaProxy.release` makes a held topic appear (the broker
  then creates it on demand).
  Each answer can be made slower in proportion to the topics it lists
  (``metadata_seconds_per_topic``).
* Produce (api key 0): its answers can be held back, each ``produce_seconds`` after the one
  before it. Records of a *refused* topic are not forwarded but answered with an error: by
  default NOT_ENOUGH_REPLICAS, a retriable one, so the producer retries them until its
  delivery timeout while the other topics' records of the same request land; or the one
  :meth:`KafkaProxy.refuse` names, such as TOPIC_AUTHORIZATION_FAILED, what Apache Kafka
  answers a producer without the topic's Write ACL.

Frames are decoded with kafka-python's protocol classes, which know every version, flexible
ones included, so kafka-python and librdkafka both work through it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import uuid
from collections import Counter
from typing import Any

from kafka.protocol.metadata import MetadataRequest, MetadataResponse
from kafka.protocol.producer import ProduceRequest, ProduceResponse

from tests.tcp_proxy import TcpProxy

PRODUCE = 0
METADATA = 3
UNKNOWN_TOPIC_OR_PARTITION = 3
NOT_ENOUGH_REPLICAS = 19
TOPIC_AUTHORIZATION_FAILED = 29
CLUSTER_AUTHORIZATION_FAILED = 31
UNKNOWN_SERVER_ERROR = -1
INVALID_RECORD = 87
#: correlation id -> (api key, api version, topics hidden from the broker: for Metadata
#: their names, for Produce their partitions and the error they are answered with)
Asked = dict[int, tuple[int, int, dict[str, tuple[list[int], int]]]]


class KafkaProxy(TcpProxy):
    def __init__(self, target_port: int, held: set[str] | None = None) -> None:
        #: held topics, and the error Metadata answers for each
        self._held = dict.fromkeys(held or (), UNKNOWN_TOPIC_OR_PARTITION)
        self._refused: dict[str, int] = {}
        #: produce requests answered with a refusal, per topic
        self.refusals: Counter[str] = Counter()
        #: Metadata answered this much later per topic it lists (a broker, or a client,
        #: whose metadata work grows with the topics asked about)
        self.metadata_seconds_per_topic = 0.0
        #: each Produce answer forwarded this much later than the one before it on its
        #: connection (a broker getting through a backlog of requests)
        self.produce_seconds = 0.0
        #: Produce answers forwarded
        self.produce_answers = 0
        super().__init__(target_port)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def release(self, topic: str) -> None:
        """The topic exists from now on (the broker creates it when asked for it)."""
        with self._lock:
            self._held.pop(topic, None)

    def refuse(self, topic: str, error_code: int = NOT_ENOUGH_REPLICAS) -> None:
        """Answer the topic's produce requests with ``error_code`` from now on."""
        with self._lock:
            self._refused[topic] = error_code

    def delete(self, topic: str) -> None:
        """The topic is gone, as after ``kafka-topics --delete``: Metadata does not know it and
        Produce is answered UNKNOWN_TOPIC_OR_PARTITION (undo with release and accept)."""
        with self._lock:
            self._held[topic] = UNKNOWN_TOPIC_OR_PARTITION
            self._refused[topic] = UNKNOWN_TOPIC_OR_PARTITION

    def accept(self, topic: str) -> None:
        """Forward the topic's produce requests again."""
        with self._lock:
            self._refused.pop(topic, None)

    def deny_describe(self, topic: str) -> None:
        """Metadata answers the topic TOPIC_AUTHORIZATION_FAILED (undo with release)."""
        with self._lock:
            self._held[topic] = TOPIC_AUTHORIZATION_FAILED

    def held(self) -> dict[str, int]:
        with self._lock:
            return dict(self._held)

    def _serve(self, client: socket.socket, upstream: socket.socket) -> None:
        asked: Asked = {}
        to_client = threading.Lock()  # the proxy's own answers and the broker's
        threading.Thread(target=self._frames, args=(client, upstream, self._request, asked,
                                                    to_client), daemon=True).start()
        threading.Thread(target=self._frames, args=(upstream, client, self._response, asked,
                                                    to_client), daemon=True).start()

    def _frames(self, source: socket.socket, sink: socket.socket, rewrite: Any, asked: Asked,
                to_client: threading.Lock) -> None:
        client = source if rewrite == self._request else sink
        try:
            while True:
                size = struct.unpack(">i", _read(source, 4))[0]
                forward, answer = rewrite(_read(source, size), asked)
                if forward:
                    if sink is client:
                        with to_client:
                            sink.sendall(forward)
                    else:
                        sink.sendall(forward)
                if answer:
                    with to_client:
                        client.sendall(answer)
        except (OSError, ConnectionError, struct.error):
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.close()

    def _request(self, body: bytes, asked: Asked) -> tuple[bytes | None, bytes | None]:
        """What to forward to the broker, and what to answer the client at once."""
        api_key, version, correlation_id = struct.unpack(">hhi", body[:8])
        hidden: dict[str, tuple[list[int], int]] = {}
        if api_key == METADATA:
            request = MetadataRequest.decode(body, version=version, header=True)
            if request.topics:
                held = self.held()
                hidden = {t.name: ([], held[t.name]) for t in request.topics if t.name in held}
                if hidden:
                    request.topics = [t for t in request.topics if t.name not in hidden]
                    body = bytes(request.encode(header=True))
        elif api_key == PRODUCE:
            with self._lock:
                refused = dict(self._refused)
            produce = ProduceRequest.decode(body, version=version, header=True)
            hidden = {t.name: ([p.index for p in t.partition_data], refused[t.name])
                      for t in produce.topic_data if t.name in refused}
            with self._lock:
                self.refusals.update(hidden.keys())  # one per request
            if hidden:
                produce.topic_data = [t for t in produce.topic_data if t.name not in hidden]
                if not produce.topic_data:
                    return None, _refusal(version, correlation_id, hidden)
                body = bytes(produce.encode(header=True))
        asked[correlation_id] = (api_key, version, hidden)
        return _framed(body), None

    def _response(self, body: bytes, asked: Asked) -> tuple[bytes, None]:
        correlation_id = struct.unpack(">i", body[:4])[0]
        api_key, version, hidden = asked.pop(correlation_id, (-1, -1, {}))
        if api_key == PRODUCE:
            time.sleep(self.produce_seconds)
            with self._lock:
                self.produce_answers += 1
        if api_key == PRODUCE and hidden:
            produced = ProduceResponse.decode(body, version=version, header=True)
            produced.responses += _refused_topics(version, hidden)
            return bytes(produced.encode(header=True, framed=True)), None
        if api_key != METADATA:
            return _framed(body), None
        response = MetadataResponse.decode(body, version=version, header=True)
        for broker in response.brokers:
            broker.host, broker.port = "127.0.0.1", self.port
        unlisted = hidden.keys() | self.held().keys()  # an all-topics request lists none
        response.topics = [t for t in response.topics if t.name not in unlisted] + [
            MetadataResponse.MetadataResponseTopic(
                error_code=error_code, name=name, topic_id=uuid.UUID(int=0),
                is_internal=False, partitions=[], version=version)
            for name, (_, error_code) in sorted(hidden.items())]
        time.sleep(self.metadata_seconds_per_topic * len(response.topics))
        return bytes(response.encode(header=True, framed=True)), None


def _refused_topics(version: int, refused: dict[str, tuple[list[int], int]]) -> list[Any]:
    topic, partition = (ProduceResponse.TopicProduceResponse,
                        ProduceResponse.TopicProduceResponse.PartitionProduceResponse)
    return [topic(name=name, topic_id=uuid.UUID(int=0), version=version, partition_responses=[
        partition(index=index, error_code=error_code, base_offset=-1,
                  log_append_time_ms=-1, log_start_offset=-1, record_errors=[],
                  error_message=None, version=version) for index in indexes])
        for name, (indexes, error_code) in refused.items()]


def _refusal(version: int, correlation_id: int, refused: dict[str, tuple[list[int], int]]
             ) -> bytes:
    """A produce response of our own, for a request that named refused topics only."""
    response = ProduceResponse(responses=_refused_topics(version, refused),
                               throttle_time_ms=0, version=version)
    response.with_header(correlation_id=correlation_id)
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
