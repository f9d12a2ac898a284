"""agent.kube.client's time limits, against a local HTTP server that answers late."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from agent.kube.client import Client, Server

DELAY_S = 1.5


class _Late(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        time.sleep(DELAY_S)
        body = b"{}"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def late_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Late)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_reply_slower_than_the_connect_limit_but_within_the_read_limit_arrives(late_server: str) -> None:
    # tried: with the limits passed positionally, urllib3 took the connect limit as the whole request's, and
    # every quiet watch broke after it ("Read timed out"), then waited out a growing backoff
    client = Client(Server(late_server), timeout=(0.5, 10.0))
    response = client.request("GET", "/slow", retries=False)
    assert response.status == 200


def test_a_reply_slower_than_the_read_limit_fails(late_server: str) -> None:
    # the keep-alive connection's socket timeout (agent.kube.keepalive), which agent.kube.errors makes status 0
    client = Client(Server(late_server), timeout=(0.5, 0.5))
    with pytest.raises(TimeoutError):
        client.request("GET", "/slow", retries=False)


def test_one_number_limits_the_whole_request(late_server: str) -> None:
    # over the keep-alive connection too (a prepare's claim read, bounded by the kubelet's deadline): the read
    # waits what the connect left, not the client's read limit
    client = Client(Server(late_server), timeout=(10.0, 10.0))
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        client.request("GET", "/slow", timeout=0.5, retries=False)
    assert time.monotonic() - began < 2.0
