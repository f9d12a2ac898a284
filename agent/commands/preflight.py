"""Checks `gpu-dra-agent node` makes before it touches anything: each failure is one sentence that names the
flag, the value and what to do, raised as StartupError. Directories the agent owns are created here with
explicit modes, whatever the umask."""

from __future__ import annotations

import math
import os
import posixpath
import re
import socket
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path

from agent.kubelet.plugin import dra_socket_path, registration_socket_path
from agent.kubelet.sockets import MAX_SOCKET_PATH
from agent.sharing.commands import DriverRoot, NotRun

STATE_DIR_MODE = 0o700  # the checkpoint and the node lock: the agent's alone
CDI_ROOT_MODE = 0o755  # the container runtime reads the specs
KUBELET_DIR_MODE = 0o750  # as the kubelet makes its plugin directories
PARENT_MODE = 0o755  # missing parents of any of them

# RFC 1123 subdomain, as the API validates Node names and (at most 63 characters) DRA driver names.
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# Kernel filesystems: writes there fail in odd ways, or worse, succeed.
_KERNEL_FS = (Path("/proc"), Path("/sys"), Path("/dev"))


class StartupError(Exception):
    """A setting the agent cannot start with; str() is the sentence for the operator."""


def dns_subdomain(flag: str, value: str, max_length: int = 253) -> str:
    if len(value) > max_length or not _DNS_SUBDOMAIN.fullmatch(value):
        raise StartupError(
            f"{flag} {value!r} is not a valid DNS subdomain (lowercase letters, digits, '-' and '.', "
            f"starting and ending with a letter or digit, at most {max_length} characters)"
        )
    return value


def interval(flag: str, seconds: float) -> float:
    if not math.isfinite(seconds) or seconds <= 0:
        raise StartupError(f"{flag} must be a positive number of seconds, not {seconds}")
    return seconds


def absolute_path(flag: str, value: str) -> str:
    """A host path as the CDI specs name it: absolute, normalised."""
    if not value.startswith("/"):
        raise StartupError(f"{flag} must be an absolute path, not {value!r}")
    return posixpath.normpath(value)


def address(flag: str, value: str) -> tuple[str, int]:
    """`[host]:port` with a port in 0..65535; the host defaults to every interface."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise StartupError(f"{flag} {value!r} is not [host]:port with a port from 0 to 65535")
    return host.strip("[]") or "0.0.0.0", int(port)


def can_listen(flag: str, value: str) -> None:
    """Bind the TCP address once (and let it go) so a taken or foreign address is refused before start-up."""
    host, port = address(flag, value)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, sockaddr = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(sockaddr)
    except OSError as exc:
        raise StartupError(f"cannot listen on {flag} {value}: {_why(exc)}") from None


def writable_dir(flag: str, path: Path, mode: int) -> Path:
    """Create `path` (and missing parents) with `mode`; refuse a file, a kernel filesystem or no write access."""
    path = Path(os.path.abspath(path))
    for kernel in _KERNEL_FS:
        if path == kernel or kernel in path.parents:
            raise StartupError(f"{flag} {path} is on the kernel filesystem {kernel}; choose a real directory")
    try:
        make_dir(path, mode)
    except FileExistsError:
        raise StartupError(f"{flag} {path} exists and is not a directory") from None
    except OSError as exc:
        raise StartupError(f"cannot create {flag} {path}: {_why(exc)}") from None
    try:
        with tempfile.TemporaryFile(dir=path, prefix=".gpu-dra-agent-probe-"):
            pass
    except OSError as exc:
        raise StartupError(f"cannot write to {flag} {path}: {_why(exc)}") from None
    return path


def make_dir(path: Path, mode: int, parent_mode: int = PARENT_MODE) -> None:
    """mkdir -p where each directory created gets exactly its mode (mkdir's mode is cut by the umask).
    An existing directory keeps its mode: an operator's choice is not ours to undo."""
    path = Path(os.path.abspath(path))
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # made meanwhile by someone else: theirs
            continue
        os.chmod(directory, mode if directory == path else parent_mode)
    if not path.is_dir():
        raise FileExistsError(path)


def kubelet_sockets(flag: str, kubelet_root: Path, driver_name: str) -> Path:
    """The plugin directories under the kubelet root, and socket paths a unix socket can have."""
    root = Path(os.path.abspath(kubelet_root))
    for sock in (registration_socket_path(root, driver_name), dra_socket_path(root, driver_name)):
        size = len(os.fsencode(sock))
        if size > MAX_SOCKET_PATH:
            raise StartupError(
                f"socket path {sock} is {size} bytes, over the {MAX_SOCKET_PATH}-byte limit of unix sockets; "
                f"use a shorter {flag}"
            )
        writable_dir(flag, sock.parent, KUBELET_DIR_MODE)
        try:
            mode = sock.lstat().st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(mode):
            raise StartupError(f"{sock} exists and is not a socket; remove it if nothing else uses it")
    return root


def driver_binaries(flag: str, root: Path, binaries: Sequence[str]) -> Path:
    """The driver root, once every binary the enabled features run is found under it (as the agent will look
    for them); otherwise one sentence naming what is missing, instead of a claim failing later."""
    found = DriverRoot(root)
    if not root.is_dir():
        raise StartupError(f"{flag} {root} is not a directory; point it at where the NVIDIA driver is installed")
    missing = []
    for binary in binaries:
        try:
            found.find(binary)
        except NotRun:
            missing.append(binary)
    if missing:
        raise StartupError(
            f"{flag} {root}: {' and '.join(missing)} not found (looked in {found.searched()}); point {flag} (or "
            "NVIDIA_DRIVER_ROOT) at where the NVIDIA driver is installed, e.g. /run/nvidia/driver with the GPU "
            "Operator's driver container"
        )
    return root


def _why(exc: OSError) -> str:
    return exc.strerror or str(exc)
