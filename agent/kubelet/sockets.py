"""Unix sockets for the kubelet: owner-only from the moment they exist, stale ones from a crash replaced."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from pathlib import Path

import grpc

SOCKET_MODE = 0o600
# sun_path holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH = 107

_umask_lock = threading.Lock()


class SocketError(RuntimeError):
    """A socket path that cannot be served safely."""


def check_socket_path(path: Path) -> None:
    if not path.is_absolute():
        raise SocketError(f"socket path {path} must be absolute (the kubelet dials it as given)")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter root")


def remove_stale(path: Path) -> None:
    """Remove a socket left behind by a previous run; refuse to delete anything that is not a socket."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise SocketError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink()


def bind(server: grpc.Server, path: Path) -> None:
    """Listen on path with mode 0600: bound under a umask that already yields 0600, then chmod to be sure.

    grpc creates the socket file in add_insecure_port, before the server starts serving.
    """
    check_socket_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    with _umask_lock:
        previous = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{path}")
        finally:
            os.umask(previous)
    os.chmod(path, SOCKET_MODE)


def remove(path: Path) -> None:
    """Remove our socket on shutdown (grpc usually has already); missing is fine."""
    with contextlib.suppress(SocketError):
        remove_stale(path)
