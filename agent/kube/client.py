"""HTTP(S) to one API server: its address, its TLS trust, our credentials and a pool of connections.

Our own, not the `kubernetes` package's: the agent speaks plain JSON (agent.kube.rest), and that package's
client loads every typed model on import (the node agent's idle RSS was 99.9 MiB with it, 54.2 MiB without).
"""

from __future__ import annotations

import math
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Protocol
from urllib.parse import urlencode

import urllib3
from urllib3.util.wait import wait_for_read

from agent.kube import writegate
from agent.kube.keepalive import KeepAlive, Reply

# (connect, read) seconds for every call: a stalled API server must fail a prepare, not hang it while the
# node lock is held.
REQUEST_TIMEOUT = (5.0, 30.0)


def _user_agent() -> str:
    try:
        version = metadata.version("gpu-dra-agent")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        version = "dev"
    return f"gpu-dra-agent/{version}"


# How the API server's audit log, metrics and `kubectl get events` name our writes.
USER_AGENT = _user_agent()

# HTTP connections kept per client (opened as needed). The arbiter's threads share one client: 64 commit
# writers, 32 gang commits, 8 watches, the Event and Queue status writers; a connection beyond the pool is
# dropped after its request (urllib3 warns "Connection pool is full") and the next one pays a TLS handshake.
POOL_CONNECTIONS = 128


class CredentialsError(Exception):
    """Our credentials cannot be read or made (a token file gone, an exec plugin failing)."""


class Auth(Protocol):
    """Who we are to the server, as request headers; refreshed by the implementation as it needs."""

    def headers(self) -> Mapping[str, str]: ...

    def rejected(self) -> None:
        """The server answered 401: forget any cached credential so the next request fetches a new one."""


class StaticHeaders:
    """Credentials that never change: an inline token, a user name and password, or none at all (client
    certificates alone, or a server that asks for nothing, as the API fake)."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        self._headers = dict(headers or {})

    def headers(self) -> Mapping[str, str]:
        return self._headers

    def rejected(self) -> None:
        pass  # nothing to fetch again


class BearerToken:
    """A token from `read()`, read again once it is `max_age_s` old or after a 401: projected service-account
    tokens and exec plugins' tokens expire, and the file or plugin has the new one first. A token read because
    of a 401 and refused too is kept for `REFUSED_AGAIN_S`: a server that refuses every token must not make
    each request run an exec plugin.

    One thread reads while the others go on with the token they have: an exec plugin may take up to a minute,
    and requests must not queue behind it. Only a request with no usable token (none read yet, or the current
    one expired or refused) waits for the read."""

    REFUSED_AGAIN_S = 10.0

    def __init__(self, read: Callable[[], tuple[str, float | None]], max_age_s: float = 60.0) -> None:
        """`read()` returns the token and, when it says so, its expiry as a time.time() instant; it raises
        CredentialsError when it cannot."""
        self._read = read
        self._max_age_s = max_age_s
        self._lock = threading.Lock()  # guards the fields below; never held across `read()`
        self._reading = threading.Lock()  # held by the one thread running `read()`
        self._token = ""
        self._stale_at = 0.0
        self._expires: float | None = None
        self._read_at = 0.0
        self._refused = False  # the current token was refused: the next read is because of it
        self._read_for_refusal = False  # the current token was read because the one before it was refused

    def headers(self) -> Mapping[str, str]:
        with self._lock:
            now = time.time()
            fresh = now < self._stale_at
            usable = bool(self._token) and not self._refused and (self._expires is None or now < self._expires)
            token = self._token
        if fresh:
            return {"Authorization": f"Bearer {token}"}
        if usable and not self._reading.acquire(blocking=False):
            return {"Authorization": f"Bearer {token}"}  # another thread is reading; this one still works
        if not usable:
            self._reading.acquire()  # nothing to send without it: wait for the thread reading, or read
        try:
            with self._lock:
                if time.time() < self._stale_at:  # read by the thread this one waited for
                    return {"Authorization": f"Bearer {self._token}"}
            token, expires = self._read()
            with self._lock:
                now = time.time()
                self._token, self._read_at, self._expires = token, now, expires
                self._read_for_refusal, self._refused = self._refused, False
                self._stale_at = now + self._max_age_s
                if expires is not None:  # a minute's margin: a token must not expire in flight
                    self._stale_at = min(self._stale_at, expires - 60.0)
                return {"Authorization": f"Bearer {token}"}
        finally:
            self._reading.release()

    def rejected(self) -> None:
        with self._lock:
            if self._read_for_refusal and time.time() - self._read_at < self.REFUSED_AGAIN_S:
                return
            self._stale_at, self._refused = 0.0, True


class RateLimiter:
    """client-go's token bucket: `qps` requests a second on average, bursts of up to `burst`. `wait()` blocks
    until the request may go. It keeps a busy writer (the arbiter's commit threads) from flooding the API
    server, which answers a flood with 429s and slows every other client."""

    def __init__(
        self,
        qps: float,
        burst: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if qps <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs qps > 0 and burst >= 1, not {qps} and {burst}")
        self.qps, self.burst = qps, burst
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._tokens = float(burst)
        self._at = clock()

    def wait(self) -> None:
        with self._lock:  # take a token now, possibly going negative: the debt is this caller's wait
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.qps) - 1.0
            self._at = now
            owed = -self._tokens / self.qps if self._tokens < 0 else 0.0
        if owed > 0:
            self._sleep(owed)


# A 429 (or a 503 during a server's start) with Retry-After is the server asking us to come back: client-go
# waits the seconds it names and tries again, up to ten times; so do we, each wait capped so a bad header
# cannot park a thread for long.
RETRY_AFTER_ATTEMPTS = 10
RETRY_AFTER_MAX_S = 10.0


# urllib3's own retries: a failed connect or read, three times, as its default; never on a status (it would
# sleep out any Retry-After uncapped, and only for methods it deems idempotent): request() does that itself
_RETRIES = urllib3.Retry(3, redirect=False, respect_retry_after_header=False)


def retry_after_seconds(reply: Reply) -> float | None:
    """The wait a 429 or 5xx response asks for (whole seconds, as the API server sends it), or None."""
    if reply.status != 429 and reply.status < 500:
        return None
    value = reply.headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the API server never sends one
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, RETRY_AFTER_MAX_S)


@dataclass(frozen=True)
class Server:
    """Where the API server is and how to trust it. `ssl_context` None: plain HTTP (the API fake on loopback)."""

    url: str  # scheme://host:port, no trailing slash
    ssl_context: ssl.SSLContext | None = None
    tls_server_name: str | None = None
    proxy_url: str | None = None


class Client:
    """Requests to one server: each thread over a keep-alive connection of its own, watches through a pool of
    `pool_size` connections (thread-safe)."""

    def __init__(
        self,
        server: Server,
        auth: Auth | None = None,
        *,
        pool_size: int = POOL_CONNECTIONS,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
        rate_limit: RateLimiter | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.server = server
        self.timeout = timeout
        self.rate_limit = rate_limit
        self._sleep = sleep
        self._auth = auth or StaticHeaders()
        tls: dict[str, Any] = {}
        if server.ssl_context is not None:
            tls["ssl_context"] = server.ssl_context
            if server.tls_server_name:
                tls["server_hostname"] = server.tls_server_name
        self._pool: urllib3.PoolManager = (
            urllib3.ProxyManager(server.proxy_url, maxsize=pool_size, **tls)
            if server.proxy_url
            else urllib3.PoolManager(maxsize=pool_size, **tls)
        )
        writegate.install(self._pool)  # a gated write is checked again right before its bytes are sent
        # every request but a watch over a connection per thread (agent.kube.keepalive); a proxy: the pool
        self._keepalive = (
            None if server.proxy_url else KeepAlive(server.url, server.ssl_context, server.tls_server_name)
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: tuple[float, float] | float | None = None,
        retries: bool = True,
    ) -> Reply:
        """One request, its response read whatever its status. `timeout`: (connect, read) seconds, or one number
        for both together. `retries` False: no silent retry of a failed connect or read (the caller's deadline is
        one attempt). A 429 or 5xx that names a Retry-After is tried again after that wait (with `retries`).
        Every request passes the rate limit, when one is set. Raises urllib3's HTTPError or OSError when the
        server cannot be reached."""
        limit = timeout or self.timeout
        for attempt in range(1, RETRY_AFTER_ATTEMPTS + 1):
            if self.rate_limit is not None:
                self.rate_limit.wait()
            target, sent = self._target(path, query, headers)  # the credentials as they are now
            if self._keepalive is not None:
                reply = self._keepalive.request(method, target, body=body, headers=sent, timeout=limit, retries=retries)
            else:  # through a proxy: urllib3's pool
                response = self._open(
                    method, target, body=body, headers=sent, limit=limit, retries=retries, stream=False
                )
                lowered = {k.lower(): v for k, v in response.headers.items()}
                reply = Reply(response.status, response.reason or "", lowered, response.data)
            if reply.status == 401:
                self._auth.rejected()
            wait = retry_after_seconds(reply) if retries else None
            if wait is None or attempt == RETRY_AFTER_ATTEMPTS:
                return reply
            self._sleep(wait)
        raise AssertionError("unreachable: the last attempt returns")

    def stream(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: tuple[float, float] | float | None = None,
        retries: bool = True,
    ) -> urllib3.BaseHTTPResponse:
        """A request whose body (a watch's events) is left unread for the caller, through urllib3's pool; no
        rate limit and no Retry-After wait (a watch's reflector starts over)."""
        target, sent = self._target(path, query, headers)
        response = self._open(
            method, target, body=None, headers=sent, limit=timeout or self.timeout, retries=retries, stream=True
        )
        if response.status == 401:
            self._auth.rejected()
        return response

    def _target(
        self, path: str, query: Mapping[str, str] | None, headers: Mapping[str, str] | None
    ) -> tuple[str, dict[str, str]]:
        """The request target (path and query) and the headers to send, the credentials' included."""
        target = path + (f"?{urlencode(query)}" if query else "")
        return target, {"User-Agent": USER_AGENT, **(headers or {}), **self._auth.headers()}

    def _open(
        self,
        method: str,
        target: str,
        *,
        body: bytes | None,
        headers: Mapping[str, str],
        limit: tuple[float, float] | float,
        retries: bool,
        stream: bool,
    ) -> urllib3.BaseHTTPResponse:
        # by name: Timeout's first positional parameter is `total`, which would cap a watch at the connect time
        deadline = (
            urllib3.Timeout(total=limit)
            if isinstance(limit, float | int)
            else urllib3.Timeout(connect=limit[0], read=limit[1])
        )
        return self._pool.request(
            method,
            self.server.url + target,
            body=body,
            headers=dict(headers),
            timeout=deadline,
            preload_content=not stream,
            retries=_RETRIES if retries else False,
            redirect=False,
        )


def drained(response: urllib3.BaseHTTPResponse) -> bool:
    """Whether nothing more of a streamed body can be read now without waiting for the server: the socket has
    nothing, TLS holds no decrypted bytes, and the response's own buffer is empty. False when unsure (no socket
    to look at, or TLS inside a proxy's TLS). A watch lingers only then, so a burst already received is never
    held back."""
    sock = getattr(response.connection, "sock", None)
    buffered = getattr(getattr(response, "_fp", None), "fp", None)  # http.client's reader of the body
    if not isinstance(sock, socket.socket) or buffered is None:
        return False
    try:
        if (isinstance(sock, ssl.SSLSocket) and sock.pending()) or wait_for_read(sock, 0.0):
            return False
        timeout = sock.gettimeout()
        sock.settimeout(0.0)  # peek: the reader's buffered bytes, or one read that cannot block
        try:
            return not buffered.peek(1)
        finally:
            sock.settimeout(timeout)
    except (ssl.SSLWantReadError, BlockingIOError):  # nothing buffered, and a read would wait
        return True
    except (OSError, ValueError):  # the body ended or the socket closed under us: the next read says so
        return False
