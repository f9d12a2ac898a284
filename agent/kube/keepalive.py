"""Requests over one keep-alive connection per thread: the client's path for every request but a watch.

Measured against kube-apiserver over TLS on loopback (issue 37), CPU per request of the calling process:
urllib3's pool 350 us for a GET from one thread and 520-550 us from 32, a connection of this module's 190 and
260. The pool's own work (URL parsing, pool keys, a locked queue, Retry objects, response wrappers) was half
of the arbiter's cost per write, and the arbiter writes three times per admitted pod. Here a request is one
buffer sent with one call and a response parsed by the standard library's http.client.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
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

    def send(self, data: bytes) -> None:
        writegate.gated_send(self, data, self._sendall)

    def _sendall(self, data: bytes) -> None:
        assert self.sock is not None, "sent on a closed connection"
        self.sock.sendall(data)

    def close(self) -> None:
        if self.sock is not None:
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
        timeout: tuple[float, float],
        retries: bool = True,
    ) -> Reply:
        """`target`: the path and query. `timeout`: (connect, read) seconds. Raises OSError (TimeoutError past
        a limit) when the server cannot be reached, or urllib3's ProtocolError when it breaks the exchange off."""
        head = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}"]
        head.extend(f"{k}: {v}" for k, v in headers.items())
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(f"Content-Length: {len(body or b'')}")
        message = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        attempts = ATTEMPTS if retries else 1
        for attempt in range(1, attempts + 1):
            connection = self._connection(timeout[0], attempts)
            try:
                return self._exchange(connection, method, message, timeout[1])
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
        response = http.client.HTTPResponse(connection.sock, method=method)
        response.begin()
        data = response.read()
        if response.will_close:
            connection.close()
            self._local.connection = None
        return Reply(response.status, response.reason, {k.lower(): v for k, v in response.msg.items()}, data)

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
