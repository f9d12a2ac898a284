"""A fake `nvidia-cuda-mps-control` over the fake GPUs of FAKE_NVML_STATE.

    CUDA_MPS_PIPE_DIRECTORY=... CUDA_MPS_LOG_DIRECTORY=... CUDA_VISIBLE_DEVICES=<uuids> nvidia-cuda-mps-control -d
    echo set_default_active_thread_percentage 50 | nvidia-cuda-mps-control
    echo quit | nvidia-cuda-mps-control

`-d` starts a control daemon in the background (double fork, own session: it outlives whoever started it,
as the real one does) that serves the pipe directory, and returns once it is ready. Without `-d` the tool
is a client: it sends each line of stdin to the daemon of CUDA_MPS_PIPE_DIRECTORY and prints the answers;
with no daemon there it fails. Commands: quit, get_server_list, set/get_default_active_thread_percentage,
set/get_default_device_pinned_mem_limit <device> <limit>.

One difference from the real daemon: the real one starts its MPS server when the first client connects;
this one registers its server (a compute process named nvidia-cuda-mps-server, pid of the daemon) on the
visible GPUs at once, since fake GPUs never get clients. The process leaves the GPUs when the daemon exits,
however it exits (the fake drops processes whose pid is gone).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fakes.nvml.smi import SmiError, find, open_gpus
from fakes.nvml.state import ALL_INSTANCES, Process

DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
SOCKET = "control"  # in the pipe directory
PID_FILE = "nvidia-cuda-mps-control.pid"
SERVER_NAME = "nvidia-cuda-mps-server"
SERVER_MEMORY = 28 << 20  # what an idle MPS server holds on a GPU
_LIMIT = re.compile(r"[0-9]+[KMGT]?")


def pipe_directory() -> Path:
    return Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY)


def log_directory() -> Path:
    return Path(os.environ.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY)


@contextlib.contextmanager
def _in_directory(path: Path):  # type: ignore[no-untyped-def]
    """AF_UNIX paths are limited to 107 bytes: bind and connect to `control` relative to its directory."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


# --- client ---------------------------------------------------------------------------------------------


def send(command: str, pipe_dir: Path) -> tuple[bool, str]:
    """One command to the daemon serving `pipe_dir`: (ok, answer). Raises ConnectionError with no daemon."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            with _in_directory(pipe_dir):
                s.connect(SOCKET)
        except OSError as exc:
            raise ConnectionError(f"Cannot find MPS control daemon process ({pipe_dir}: {exc.strerror})") from exc
        s.sendall(command.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        data = b"".join(iter(lambda: s.recv(65536), b""))
    status, _, text = data.decode().partition("\n")
    return status == "OK", text


def client(stdin_lines: Sequence[str], pipe_dir: Path) -> int:
    code = 0
    for line in stdin_lines:
        command = line.strip()
        if not command:
            continue
        try:
            ok, text = send(command, pipe_dir)
        except ConnectionError as exc:
            print(exc, file=sys.stderr)
            return 1
        (sys.stdout if ok else sys.stderr).write(text)
        code = code or (0 if ok else 1)
    return code


# --- daemon ---------------------------------------------------------------------------------------------


@dataclass
class Daemon:
    pipe_dir: Path
    log_dir: Path
    devices: list[str]  # visible device uuids, in CUDA_VISIBLE_DEVICES order
    thread_percentage: float = 100.0
    pinned_limits: dict[str, str] = field(default_factory=dict)  # uuid -> "1024M"

    def log(self, text: str) -> None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
        with open(self.log_dir / "control.log", "a") as f:
            f.write(f"[{stamp} Control {os.getpid():>6}] {text}\n")

    def device(self, ident: str) -> str:
        if ident.isdigit() and int(ident) < len(self.devices):
            return self.devices[int(ident)]
        if ident in self.devices:
            return ident
        raise ValueError(f"Invalid device {ident!r}: not one of the {len(self.devices)} visible device(s)")

    def handle(self, command: str) -> tuple[bool, str, bool]:
        """(ok, answer, stop)."""
        words = command.split()
        name, args = words[0], words[1:]
        try:
            if name == "quit" and len(args) <= 2:  # `quit [-t <seconds>]`
                return True, "", True
            if name == "get_server_list" and not args:
                return True, f"{os.getpid()}\n", False
            if name == "set_default_active_thread_percentage" and len(args) == 1:
                value = _percentage(args[0])
                self.thread_percentage = value
                return True, f"{value:.1f}\n", False
            if name == "get_default_active_thread_percentage" and not args:
                return True, f"{self.thread_percentage:.1f}\n", False
            if name == "set_default_device_pinned_mem_limit" and len(args) == 2:
                self.pinned_limits[self.device(args[0])] = _limit(args[1])
                return True, "", False
            if name == "get_default_device_pinned_mem_limit" and len(args) == 1:
                return True, self.pinned_limits.get(self.device(args[0]), "N/A") + "\n", False
        except ValueError as exc:
            return False, f"{exc}\n", False
        return False, f"Unrecognized command {command!r}\n", False

    def serve(self, listener: socket.socket) -> None:
        self.log(f"Starting control daemon using socket {self.pipe_dir / SOCKET}; devices {','.join(self.devices)}")
        while True:
            conn, _ = listener.accept()
            with conn:
                data = b"".join(iter(lambda c=conn: c.recv(65536), b""))  # type: ignore[misc]
                command = data.decode(errors="replace").strip()
                ok, text, stop = self.handle(command) if command else (False, "empty command\n", False)
                self.log(f"{'Accepting' if ok else 'Refusing'} command {command!r}")
                conn.sendall((("OK" if ok else "ERR") + "\n" + text).encode())
            if stop:
                self.log("Exit")
                return


def _percentage(text: str) -> float:
    value = float(text)
    if not 0 < value <= 100:
        raise ValueError(f"Invalid active thread percentage {text}: must be in (0, 100]")
    return value


def _limit(text: str) -> str:
    if not _LIMIT.fullmatch(text):
        raise ValueError(f"Invalid memory limit {text!r}: want <n>[K|M|G|T]")
    return text


def _visible_devices() -> list[str]:
    """CUDA_VISIBLE_DEVICES as uuids (GPU-/MIG- uuids or indexes); every GPU when unset."""
    fake = open_gpus()
    wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
    if wanted is None:
        return [g.uuid for g in fake.gpus if not g.lost]
    out = []
    for ident in filter(None, (w.strip() for w in wanted.split(","))):
        gpu, mig = find(fake, ident)
        out.append(ident if (mig or ident.startswith("GPU-")) else gpu.uuid)
    return out


def _register_server(devices: Sequence[str], pid: int) -> None:
    """The MPS server shows as a compute process on each device it serves (leaves with the pid)."""
    fake = open_gpus()
    with fake.mutation():
        for uuid in devices:
            gpu, mig = find(fake, uuid)
            gi = ci = ALL_INSTANCES
            if mig:
                dev = next(c for c in gpu.mig_devices() if c.uuid == uuid)
                gi, ci = dev.gpu_instance.id, dev.id
            gpu.processes = [
                p for p in gpu.processes if p.pid != pid or (p.gpu_instance_id, p.compute_instance_id) != (gi, ci)
            ]
            gpu.processes.append(Process(pid, SERVER_MEMORY, gi, ci, SERVER_NAME, tracked=True))


def _unregister_server(pid: int) -> None:
    fake = open_gpus()
    with fake.mutation():
        for gpu in fake.gpus:
            gpu.processes = [p for p in gpu.processes if p.pid != pid]


def start_daemon() -> int:
    pipe_dir, log_dir = pipe_directory(), log_directory()
    try:
        devices = _visible_devices()
        pipe_dir.mkdir(parents=True, exist_ok=True)
        log_dir.mkdir(parents=True, exist_ok=True)
    except (SmiError, OSError, ValueError) as exc:
        print(f"nvidia-cuda-mps-control: {exc}", file=sys.stderr)
        return 1
    with contextlib.suppress(ConnectionError):
        send("get_server_list", pipe_dir)
        print("An instance of this daemon is already running", file=sys.stderr)
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with _in_directory(pipe_dir):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(SOCKET)  # left by a daemon that was killed
        listener.bind(SOCKET)
    listener.listen(16)
    ready_r, ready_w = os.pipe()
    if os.fork() > 0:  # the caller: wait until the daemon says it is ready
        os.close(ready_w)
        listener.close()
        with os.fdopen(ready_r, "rb") as ready:
            ok = ready.read() == b"ok"
        if not ok:
            print("nvidia-cuda-mps-control: the daemon failed to start", file=sys.stderr)
        return 0 if ok else 1
    os.close(ready_r)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    _become_daemon(listener, ready_w, Daemon(pipe_dir.resolve(), log_dir.resolve(), devices))
    return 0  # not reached


def _become_daemon(listener: socket.socket, ready_w: int, daemon: Daemon) -> None:
    code = 0
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        _register_server(daemon.devices, os.getpid())
        (daemon.pipe_dir / PID_FILE).write_text(f"{os.getpid()}\n")
        os.write(ready_w, b"ok")
        os.close(ready_w)
        daemon.serve(listener)
    except BaseException:  # a daemon has nowhere to report but its exit status
        code = 1
    finally:
        with contextlib.suppress(Exception):
            _unregister_server(os.getpid())
        for name in (SOCKET, PID_FILE):
            with contextlib.suppress(OSError):
                (daemon.pipe_dir / name).unlink()
        os._exit(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["-d"]:
        return start_daemon()
    if args:
        print(
            f"nvidia-cuda-mps-control: unsupported arguments {args!r} (fake supports -d or commands on stdin)",
            file=sys.stderr,
        )
        return 2
    return client(sys.stdin.read().splitlines(), pipe_directory())


if __name__ == "__main__":
    sys.exit(main())
