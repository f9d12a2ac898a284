"""A write's gate (agent.kube.rest's `write_gate`), checked before the request and again before its bytes leave.

`guarded` checks the gate at once, so a refused write waits for nothing (the rate limiter, a credential); the
request may then wait (the rate limiter, a Retry-After, the GIL behind the other threads) long enough for a
paused leader to lose its Lease meanwhile. So the gate is checked again on every send of the request's bytes,
right before the socket call, and a refused send closes the connection: the server never gets a whole
request. What is left is a pause between the clock's read in that check and the socket call: a few bytecodes,
and at most one point where the thread may wait for the GIL (after the clock's read itself), which a pause
landing there widens. Only a fence the server enforces would close it; the API has none for a Lease.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import urllib3
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

_local = threading.local()  # the gate of the request this thread is sending, if any


@contextlib.contextmanager
def guarded(gate: Callable[[], None] | None) -> Iterator[None]:
    """`gate` checked now, and by every send this thread makes inside the block (None: no check)."""
    if gate is not None:
        gate()
    previous = getattr(_local, "gate", None)
    _local.gate = gate
    try:
        yield
    finally:
        _local.gate = previous


class Connection(Protocol):
    """What a gated send needs of a connection: its socket (None before it connects) and a way to close it."""

    @property
    def sock(self) -> socket.socket | None: ...

    def close(self) -> None: ...


def gated_send(connection: Connection, data: Any, send: Callable[[Any], None]) -> None:
    """`send(data)` on `connection` once this thread's gate (if any) passes; a refusal closes the connection."""
    gate: Callable[[], None] | None = getattr(_local, "gate", None)
    if gate is None:
        send(data)
        return
    sock = connection.sock
    # chosen before the check: a call between the check and the socket call is a point where this thread can
    # wait for the GIL, and a pause there (SIGSTOP, a VM frozen) sends after the Lease is lost
    raw = sock.sendall if sock is not None and isinstance(data, bytes | bytearray | memoryview) else send
    try:
        gate()
    except BaseException:
        connection.close()  # whatever part of the request went out stays incomplete: the server drops it
        raise
    raw(data)  # nothing between the check and the socket call


class _GatedHTTPConnection(HTTPConnection):
    def send(self, data: Any) -> None:
        gated_send(self, data, super().send)


class _GatedHTTPSConnection(HTTPSConnection):
    def send(self, data: Any) -> None:
        gated_send(self, data, super().send)


class _GatedPool(HTTPConnectionPool):
    ConnectionCls = _GatedHTTPConnection


class _GatedTlsPool(HTTPSConnectionPool):
    ConnectionCls = _GatedHTTPSConnection


def install(manager: urllib3.PoolManager) -> None:
    """Make `manager`'s connections consult the gate of `guarded` on every send."""
    manager.pool_classes_by_scheme = {"http": _GatedPool, "https": _GatedTlsPool}
