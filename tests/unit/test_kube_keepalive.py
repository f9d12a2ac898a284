"""agent.kube.keepalive: each thread's requests over one kept-open connection, a connection the server closed
replaced, and a write that may have reached the server never sent twice. Against a local HTTP/1.1 server on
loopback that counts the connections it accepts."""

from __future__ import annotations

import http.client
import http.server
import io
import socket
import threading
import time
from collections.abc import Iterator
from typing import ClassVar

import pytest

from agent.kube.client import Client, Server
from agent.kube.errors import ApiError
from agent.kube.keepalive import read_reply
from agent.kube.rest import PODS, Rest


class _Counting(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless told otherwise
    connections: ClassVar[list[int]] = []
    requests: ClassVar[list[str]] = []
    drop_posts = False  # a POST read and the connection cut without an answer
    close_after = False  # each answer followed by closing the connection unannounced, as an idle timeout does

    def setup(self) -> None:
        super().setup()
        type(self).connections.append(1)

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        type(self).requests.append(f"{self.command} {self.path} {len(body)}")
        if self.command == "POST" and type(self).drop_posts:
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        out = b'{"kind": "Pod", "metadata": {"name": "p"}}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)
        self.close_connection = type(self).close_after

    do_GET = do_PUT = do_POST = _answer  # noqa: N815 (http.server's names)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[http.server.ThreadingHTTPServer]:
    _Counting.connections, _Counting.requests = [], []
    _Counting.drop_posts = _Counting.close_after = False
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _rest(srv: http.server.ThreadingHTTPServer) -> Rest:
    return Rest(Client(Server(f"http://127.0.0.1:{srv.server_address[1]}")))


def test_a_threads_requests_share_one_connection_and_each_thread_has_its_own(
    server: http.server.ThreadingHTTPServer,
) -> None:
    """Ten GETs and PUTs from one thread, then one GET from each of three more threads: four connections."""
    rest = _rest(server)
    for _ in range(5):
        assert rest.get(PODS, "ns", "p")["metadata"]["name"] == "p"
        rest.replace(PODS, {"metadata": {"namespace": "ns", "name": "p"}, "spec": {}})
    threads = [threading.Thread(target=rest.get, args=(PODS, "ns", "p")) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(_Counting.requests) == 13
    assert len(_Counting.connections) == 4


def test_a_connection_the_server_closed_while_idle_is_replaced(server: http.server.ThreadingHTTPServer) -> None:
    """The server closes the connection after answering a GET, unannounced (no `Connection: close`), as an
    idle timeout would: the thread's next GET succeeds over a new connection."""
    _Counting.close_after = True
    rest = _rest(server)
    rest.get(PODS, "ns", "p")
    time.sleep(0.1)  # idle
    assert rest.get(PODS, "ns", "p")["metadata"]["name"] == "p"
    assert len(_Counting.connections) == 2 and len(_Counting.requests) == 2


def test_a_post_cut_off_after_it_was_sent_is_not_sent_again(server: http.server.ThreadingHTTPServer) -> None:
    """The server reads a POST and closes without answering (it may have applied it): one attempt, an error of
    status 0, where a GET cut off the same way would have been tried again."""
    _Counting.drop_posts = True
    rest = _rest(server)
    with pytest.raises(ApiError) as failed:
        rest.create(PODS, "ns", {"metadata": {"name": "p"}})
    assert failed.value.status == 0
    assert [r for r in _Counting.requests if r.startswith("POST")] == [_Counting.requests[0]]
    assert len(_Counting.requests) == 1


@pytest.mark.parametrize(
    ("raw", "method", "status", "data", "keep"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", "GET", 200, b"{}", True),
        # chunked, with a chunk extension and a trailer, as Go's net/http may send
        (
            b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nT: 1\r\n\r\n",
            "POST",
            201,
            b"abcde",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\nx", "GET", 200, b"x", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nx", "GET", 200, b"x", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nx", "GET", 200, b"x", True),
        (b"HTTP/1.1 200 OK\r\n\r\nto the end", "GET", 200, b"to the end", False),  # no length: read to EOF
        (b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 409 Conflict\r\nContent-Length: 0\r\n\r\n", "PUT", 409, b"", True),
        (b"HTTP/1.1 204 No Content\r\n\r\n", "DELETE", 204, b"", True),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", "HEAD", 200, b"", True),
    ],
)
def test_a_response_is_read_whole_and_says_whether_the_connection_stays(
    raw: bytes, method: str, status: int, data: bytes, keep: bool
) -> None:
    """Each way a body is delimited (length, chunks, the connection's end, none), and who keeps the
    connection open: the body read is exactly the response's, the status the final one's."""
    reader = io.BytesIO(raw + (b"NEXT" if keep else b""))  # a kept connection: the next response follows
    reply, kept = read_reply(reader, method)
    assert (reply.status, reply.data, kept) == (status, data, keep)
    if keep:
        assert reader.read() == b"NEXT"  # nothing of the next response consumed


def test_retry_after_is_found_whatever_the_case_of_its_name() -> None:
    reply, _ = read_reply(
        io.BytesIO(b"HTTP/1.1 429 Too Many Requests\r\nRETRY-AFTER: 2\r\nContent-Length: 0\r\n\r\n"), "GET"
    )
    assert reply.headers["retry-after"] == "2" and reply.reason == "Too Many Requests"


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"", http.client.RemoteDisconnected),
        (b"SSH-2.0-OpenSSH\r\n\r\n", http.client.BadStatusLine),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", http.client.IncompleteRead),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", http.client.IncompleteRead),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", http.client.IncompleteRead),
    ],
)
def test_what_is_no_whole_response_raises(raw: bytes, error: type[Exception]) -> None:
    """A closed connection, something not HTTP, and bodies cut short: http.client's errors, which the client
    turns into a failed request (and a retry where the method allows one)."""
    with pytest.raises(error):
        read_reply(io.BytesIO(raw), "GET")


def test_one_limit_for_the_whole_request_goes_over_the_threads_connection(
    server: http.server.ThreadingHTTPServer,
) -> None:
    """GETs bounded by one number (connect and read together, as a prepare reads its claim within the kubelet's
    deadline) and GETs with the client's (connect, read) pair: all over the thread's one connection."""
    rest = _rest(server)
    for _ in range(3):
        assert rest.get(PODS, "ns", "p", timeout=5.0)["metadata"]["name"] == "p"
        assert rest.get(PODS, "ns", "p")["metadata"]["name"] == "p"
    assert len(_Counting.requests) == 6
    assert len(_Counting.connections) == 1
