"""Whether a broker answers TLS at all, asked before a kafka-python client is made.

kafka-python waits for the broker's half of a TLS handshake with no deadline: its
``bootstrap_timeout_ms`` bounds connecting and the metadata request, not the handshake. A
relay or reconciliation set to SSL or SASL_SSL against a plaintext listener (which reads the
ClientHello as the start of a request and waits for the rest of it) hung for good, deaf to
SIGTERM, where librdkafka gives up after its connect timeout. So each bootstrap broker is
asked for a handshake first, within ``kafka_connect_timeout_ms`` in all: the first that
answers, even with an error (a certificate the client would refuse, which the client then
says), lets the client be made; none answering is the one line of
:meth:`~outbox.settings.KafkaSettings.kafka_unreachable`.
"""

from __future__ import annotations

import socket
import ssl
import time

from outbox.settings import KafkaSettings, split_host

DEFAULT_PORT = 9092


def require_tls_answer(settings: KafkaSettings) -> None:
    """Raise ``settings.kafka_unreachable()`` if TLS is on and no bootstrap broker completes
    a handshake (or answers one with an error) within ``kafka_connect_timeout_ms``; first,
    the ConfigurationError of a TLS file that cannot be read."""
    if not settings.kafka_security_protocol.endswith("SSL"):
        return
    settings.kafka_security()  # a TLS file missing is named first, not taken for silence
    context = ssl.create_default_context()
    context.check_hostname = False  # only whether it speaks TLS: the client verifies
    context.verify_mode = ssl.CERT_NONE
    deadline = time.monotonic() + settings.kafka_connect_timeout_ms / 1000
    for host, port in map(split_host, settings.kafka_bootstrap.split(",")):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port or DEFAULT_PORT), timeout=left) as raw:
                raw.settimeout(max(deadline - time.monotonic(), 0.001))
                with context.wrap_socket(raw, server_hostname=host):
                    return
        except ssl.SSLError:
            return  # it answered in TLS, with an error of its own
        except OSError:  # refused, unreachable, silent past the deadline
            continue
    raise settings.kafka_unreachable()

