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


def bind(server: grpc.Server, path: Path) -> tuple[int, int]:
    """Listen on path with mode 0600; returns the socket file's identity (device, inode) for `remove`.

    grpc creates the socket file in add_insecure_port (under a umask that already yields 0600, then chmod to
    be sure) and unlinks that path again when the server stops. So the socket is bound at a hidden temporary
    name (the kubelet's plugin watcher skips dot files) and renamed into place: the rename atomically
    replaces a stale socket, and grpc's unlink at shutdown can never remove a successor's socket.
    """
    check_socket_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{os.getpid()}")
    check_socket_path(temp)
    remove_stale(path)  # refuses a non-socket there before anything is created
    remove_stale(temp)
    with _umask_lock:
        previous = os.umask(0o177)
        try:
            server.add_insecure_port(f"unix:{temp}")
        finally:
            os.umask(previous)
    os.chmod(temp, SOCKET_MODE)
    os.replace(temp, path)
    info = path.lstat()
    return info.st_dev, info.st_ino


def remove(path: Path, identity: tuple[int, int]) -> None:
    """Remove our socket on shutdown (grpc usually has already); missing is fine. A socket at the path that
    is not the one we bound (a successor's, during a rolling update) is left alone."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(info.st_mode) and (info.st_dev, info.st_ino) == identity:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
