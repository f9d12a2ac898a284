"""Per-claim MPS control daemons: `nvidia-cuda-mps-control -d` with the claim's own pipe and log directories.

A daemon is found by its pipe directory alone (`<state dir>/mps/<claim uid>/pipe`), so a restarted agent
reaches the daemons it started before it was killed: they run in their own session and outlive it, as
NVIDIA's per-claim MPS deployments outlive its kubelet plugin.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from agent.sharing.commands import CommandRunner, SharingError, checked
from agent.sharing.plan import MpsPlan

MPS_CONTROL = "nvidia-cuda-mps-control"
PID_FILE = "nvidia-cuda-mps-control.pid"  # the daemon writes it into its pipe directory
CONTAINER_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # noqa: S108 (inside the container; NVIDIA's path)
STOP_WAIT_S = 10.0


@dataclass(frozen=True)
class MpsDirs:
    root: Path

    @property
    def pipe(self) -> Path:
        return self.root / "pipe"

    @property
    def log(self) -> Path:
        return self.root / "log"

    def env(self) -> dict[str, str]:
        return {"CUDA_MPS_PIPE_DIRECTORY": str(self.pipe), "CUDA_MPS_LOG_DIRECTORY": str(self.log)}


class MpsDaemons:
    def __init__(self, runner: CommandRunner, base: Path) -> None:
        self.runner = runner
        self.base = base

    def dirs(self, claim_uid: str) -> MpsDirs:
        return MpsDirs(self.base / claim_uid)

    def claim_uids(self) -> set[str]:
        """Claims with MPS directories here (a daemon may or may not run for each)."""
        return {p.name for p in self.base.iterdir() if p.is_dir()} if self.base.is_dir() else set()

    def running(self, claim_uid: str) -> bool:
        dirs = self.dirs(claim_uid)
        if not dirs.pipe.is_dir():
            return False
        done = self.runner.run(MPS_CONTROL, [], stdin="get_server_list\n", env=dirs.env())
        return done.returncode == 0

    def start(self, claim_uid: str, plan: MpsPlan) -> None:
        """Start the claim's daemon (or keep the one already serving its pipe directory) and set its limits."""
        dirs = self.dirs(claim_uid)
        running = self.running(claim_uid)  # before the directories exist it costs no process
        for d in (dirs.pipe, dirs.log):
            d.mkdir(parents=True, exist_ok=True, mode=0o755)
        if not running:
            env = dirs.env() | {"CUDA_VISIBLE_DEVICES": ",".join(plan.devices)}
            checked(self.runner, MPS_CONTROL, ["-d"], env=env)
        commands = []
        if plan.active_thread_percentage is not None:
            commands.append(f"set_default_active_thread_percentage {plan.active_thread_percentage}")
        commands += [f"set_default_device_pinned_mem_limit {uuid} {mib}M" for uuid, mib in plan.pinned_memory_mib]
        if commands:
            checked(self.runner, MPS_CONTROL, [], stdin="\n".join(commands) + "\n", env=dirs.env())

    def stop(self, claim_uid: str) -> None:
        """`quit` the claim's daemon, wait for it to exit, remove its directories (no daemon: just the latter)."""
        dirs = self.dirs(claim_uid)
        pid = _read_pid(dirs.pipe / PID_FILE)
        if self.running(claim_uid):
            checked(self.runner, MPS_CONTROL, [], stdin="quit\n", env=dirs.env())
            if pid is not None and not _wait_gone(pid, STOP_WAIT_S):
                raise SharingError(f"the MPS control daemon of claim {claim_uid} (pid {pid}) did not exit "
                                   f"within {STOP_WAIT_S:g}s of quit")  # fmt: skip
        shutil.rmtree(dirs.root, ignore_errors=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def _alive(pid: int) -> bool:
    """Running, not exited (a zombie its parent has not reaped yet counts as exited)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(ChildProcessError):  # reap it if it happens to be our child
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return stat.rsplit(b")", 1)[-1].split()[:1] != [b"Z"]
