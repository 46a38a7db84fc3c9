"""The console reads the relays' /metrics when its page loads: an endpoint that answers
with something else is shown down, and the others still show."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from outbox.console.scrape import scrape_all

PAGES = {
    "/metrics": b"# TYPE outbox_messages_delivered_total counter\n"
                b"outbox_messages_delivered_total{topic=\"a\"} 3\n"
                b"outbox_messages_delivered_total{topic=\"b\"} 4\n"
                b"# TYPE outbox_relay_owned_shards gauge\noutbox_relay_owned_shards 16\n",
    "/html": b"<!DOCTYPE HTML>\n<html><body>the console itself</body></html>\n",
    "/inf": b"# TYPE outbox_relay_owned_shards gauge\noutbox_relay_owned_shards +Inf\n"
            b"# TYPE outbox_messages_parked_total counter\noutbox_messages_parked_total NaN\n",
}


class Pages(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = PAGES[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_page_that_is_not_metrics_is_shown_down_and_the_others_still_show(server: str
                                                                            ) -> None:
    relay, wrong = scrape_all([f"{server}/metrics", f"{server}/html"])
    assert (relay.up, relay.kind, relay.values) == (True, "relay", {
        "delivered": 7.0, "shards owned": 16.0})
    assert not wrong.up
    assert wrong.error is not None and wrong.error.startswith("not Prometheus metrics")


@pytest.fixture
def not_http() -> Iterator[str]:
    """A port answering like PostgreSQL (a wrong port in the list): not HTTP at all."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"EFATAL\x00VFATAL\x00C0A000\x00Munsupported protocol\x00\x00")

    threading.Thread(target=answer, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}/metrics"
    listener.close()


def test_a_port_that_does_not_speak_http_is_shown_down(server: str, not_http: str) -> None:
    """http.client's errors for a reply that is not HTTP are neither OSError nor ValueError:
    they escaped, and the console's page answered 500."""
    relay, wrong = scrape_all([f"{server}/metrics", not_http])
    assert relay.up
    assert not wrong.up and wrong.error is not None and "HTTP" in wrong.error, wrong.error


def test_values_that_are_no_number_are_left_out(server: str) -> None:
    """A +Inf gauge was shown as up, then the page's integer filter raised OverflowError."""
    [odd] = scrape_all([f"{server}/inf"])
    assert (odd.up, odd.kind, odd.values) == (True, "relay", {})


def test_only_http_urls_are_taken() -> None:
    from outbox.exceptions import ConfigurationError
    from outbox.settings import ConsoleSettings, load_settings

    with pytest.raises(ConfigurationError, match="'file:///etc/hostname' is not an http"):
        load_settings(ConsoleSettings, console_metrics_urls=["file:///etc/hostname"])
