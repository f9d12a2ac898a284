"""Requests over one keep-alive connection per thread: the client's path for every request but a watch.

Measured against kube-apiserver over TLS on loopback (issue 37), CPU per request of the calling process:
urllib3's pool 350 us for a GET from one thread and 520-550 us from 32, a connection of this module's 190 and
260. The pool's own work (URL parsing, pool keys, a locked queue, Retry objects, response wrappers) was half
of the arbiter's cost per write, and the arbiter writes three times per admitted pod. Here a request is one
buffer sent with one call, and a response parsed by `read_reply`.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO
from urllib.parse import urlsplit

import urllib3
from urllib3.util.wait import wait_for_read

from agent.kube import writegate

# urllib3's Retry(3) as the pool used it: a failed connect is tried again for any method, a failure after the
# request went out only for a method the server applies at most once (a POST may have been applied)
ATTEMPTS = 4
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole response: the status, its headers (names in lower case) and the body read."""

    status: int
    reason: str
    headers: Mapping[str, str]
    data: bytes


class _Connection:
    """One socket to the server, TLS-wrapped where the server is https, and its writes passing the write gate."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock: socket.socket | None = sock
        self.reader = sock.makefile("rb")  # one buffer for the connection's responses, read in turn

    def send(self, data: bytes) -> None:
        writegate.gated_send(self, data, self._sendall)

    def _sendall(self, data: bytes) -> None:
        assert self.sock is not None, "sent on a closed connection"
        self.sock.sendall(data)

    def close(self) -> None:
        if self.sock is not None:
            self.reader.close()
            self.sock.close()
            self.sock = None


class KeepAlive:
    """Requests to one server, each thread over a connection of its own kept open between its requests."""

    def __init__(self, url: str, ssl_context: ssl.SSLContext | None = None, tls_server_name: str | None = None) -> None:
        parts = urlsplit(url)
        if parts.hostname is None:
            raise ValueError(f"no host in the server's address {url!r}")
        self._address = (parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
        self._host_header = parts.netloc.rsplit("@", 1)[-1]
        self._tls = ssl_context if parts.scheme == "https" else None
        self._server_name = tls_server_name or parts.hostname
        self._local = threading.local()

    def request(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
        timeout: tuple[float, float] | float,
        retries: bool = True,
    ) -> Reply:
        """`target`: the path and query. `timeout`: (connect, read) seconds, or one number for connecting and
        reading together (each attempt: the read waits what the connect left, at every wait for the server, as
        urllib3's total does). Raises OSError (TimeoutError past a limit) when the server cannot be reached, or
        urllib3's ProtocolError when it breaks the exchange off."""
        head = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        head.extend(f"{k}: {v}" for k, v in headers.items())
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        attempts = ATTEMPTS if retries else 1
        connect_s, read_s = timeout if isinstance(timeout, tuple) else (timeout, None)  # None: what connect left
        for attempt in range(1, attempts + 1):
            started = time.monotonic()
            connection = self._connection(connect_s, attempts)
            wait_s = read_s if read_s is not None else max(0.001, started + connect_s - time.monotonic())
            try:
                return self._exchange(connection, method, message, wait_s)
            except (OSError, http.client.HTTPException) as exc:
                connection.close()
                self._local.connection = None
                if attempt == attempts or method not in _IDEMPOTENT:
                    if isinstance(exc, http.client.HTTPException):
                        raise urllib3.exceptions.ProtocolError(f"Connection aborted: {exc!r}", exc) from exc
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _exchange(self, connection: _Connection, method: str, message: bytes, read_s: float) -> Reply:
        assert connection.sock is not None
        connection.sock.settimeout(read_s)
        connection.send(message)
        reply, keep = read_reply(connection.reader, method)
        if not keep:
            connection.close()
            self._local.connection = None
        return reply

    def _connection(self, connect_s: float, attempts: int) -> _Connection:
        """This thread's connection, a new one when it has none or the server closed it while idle."""
        connection: _Connection | None = getattr(self._local, "connection", None)
        if connection is not None and connection.sock is not None and not wait_for_read(connection.sock, 0.0):
            return connection  # idle and open: anything readable now would be the server's close
        if connection is not None:
            connection.close()
        self._local.connection = None
        connection = _Connection(self._connect(connect_s, attempts))
        self._local.connection = connection
        return connection

    def _connect(self, connect_s: float, attempts: int) -> socket.socket:
        """A new socket; a failure to connect is tried again (every method: nothing was sent yet)."""
        for attempt in range(1, attempts + 1):
            try:
                sock = socket.create_connection(self._address, timeout=connect_s)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    if self._tls is not None:
                        sock = self._tls.wrap_socket(sock, server_hostname=self._server_name)
                        if self._tls.verify_mode == ssl.CERT_NONE:  # the operator's choice, said as urllib3 says it
                            warnings.warn(
                                f"Unverified HTTPS connection to {self._host_header}: insecure-skip-tls-verify",
                                urllib3.exceptions.InsecureRequestWarning,
                                stacklevel=2,
                            )
                except BaseException:
                    sock.close()
                    raise
                return sock
            except OSError:
                if attempt == attempts:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")


_MAX_LINE = 65536
_MAX_HEADERS = 100


def read_reply(reader: BinaryIO, method: str) -> tuple[Reply, bool]:
    """One HTTP/1.x response from `reader` and whether the connection stays open after it. Parsed here, not
    by http.client.HTTPResponse, whose headers go through the email package: a PUT to kube-apiserver cost 227 us
    of CPU with it and 154 with this. Raises http.client's errors for what is not a response or ends early."""
    while True:
        line = _line(reader)
        if not line:
            raise http.client.RemoteDisconnected("the server closed the connection without a response")
        version, _, rest = line.partition(b" ")
        code, _, reason = rest.strip().partition(b" ")
        if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise http.client.BadStatusLine(repr(line))
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS + 1):
            field = _line(reader)
            if field in (b"\r\n", b"\n", b""):
                break
            name, colon, value = field.decode("latin-1").partition(":")
            if not colon:
                raise http.client.HTTPException(f"not a header: {field!r}")
            headers[name.strip().lower()] = value.strip()
        else:
            raise http.client.HTTPException(f"more than {_MAX_HEADERS} headers")
        status = int(code)
        if status >= 200 or status == 101:
            break  # a 1xx before the answer (100 Continue): skipped
    tokens = headers.get("connection", "").lower()
    keep = "keep-alive" in tokens if version == b"HTTP/1.0" else "close" not in tokens
    if method == "HEAD" or status in (204, 304):
        data = b""
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        data = _chunked(reader)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        data = reader.read(length)
        if len(data) < length:
            raise http.client.IncompleteRead(data, length - len(data))
    else:  # the body runs to the end of the connection
        data, keep = reader.read(), False
    return Reply(status, reason.decode("latin-1").strip(), headers, data), keep


def _line(reader: BinaryIO) -> bytes:
    line = reader.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise http.client.LineTooLong("response line")
    return line


def _chunked(reader: BinaryIO) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = _line(reader)
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise http.client.IncompleteRead(b"".join(parts)) from None
        if size == 0:
            while _line(reader) not in (b"\r\n", b"\n", b""):  # trailers: none the API server sends matter
                pass
            return b"".join(parts)
        chunk = reader.read(size + 2)  # and its CRLF
        if len(chunk) < size + 2:
            raise http.client.IncompleteRead(chunk)
        parts.append(chunk[:size])
