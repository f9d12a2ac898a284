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

from agent.sharing.commands import CommandFailed, CommandRunner, NotRun, SharingError, checked
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

    def pid(self, claim_uid: str) -> int | None:
        """The pid the claim's daemon wrote into its pipe directory, if any."""
        return _read_pid(self.dirs(claim_uid).pipe / PID_FILE)

    def running(self, claim_uid: str) -> bool:
        """Whether the claim's daemon answers. A daemon whose pid is gone is not asked (no process is run)."""
        dirs = self.dirs(claim_uid)
        if not dirs.pipe.is_dir():
            return False
        pid = self.pid(claim_uid)
        if pid is not None and not alive(pid):
            return False
        done = self.runner.run(MPS_CONTROL, [], stdin="get_server_list\n", env=dirs.env())
        return done.returncode == 0

    def start(self, claim_uid: str, plan: MpsPlan) -> None:
        """Start the claim's daemon (or keep the one already serving its pipe directory) and set its limits."""
        self.launch(claim_uid, plan)
        self.set_limits(claim_uid, plan)

    def launch(self, claim_uid: str, plan: MpsPlan) -> None:
        """Start the claim's daemon unless one serves its pipe directory already. When `-d` fails nothing is
        left behind: no daemon, no directories."""
        dirs = self.dirs(claim_uid)
        if self.running(claim_uid):  # before the directories exist it costs no process
            return
        for d in (dirs.pipe, dirs.log):
            d.mkdir(parents=True, exist_ok=True, mode=0o755)
        env = dirs.env() | {"CUDA_VISIBLE_DEVICES": ",".join(plan.devices)}
        try:
            checked(self.runner, MPS_CONTROL, ["-d"], env=env)
        except (NotRun, CommandFailed):
            shutil.rmtree(dirs.root, ignore_errors=True)
            raise

    def set_limits(self, claim_uid: str, plan: MpsPlan) -> None:
        commands = []
        if plan.active_thread_percentage is not None:
            commands.append(f"set_default_active_thread_percentage {plan.active_thread_percentage}")
        commands += [f"set_default_device_pinned_mem_limit {uuid} {mib}M" for uuid, mib in plan.pinned_memory_mib]
        if commands:
            checked(self.runner, MPS_CONTROL, [], stdin="\n".join(commands) + "\n", env=self.dirs(claim_uid).env())

    def stop(self, claim_uid: str) -> None:
        """`quit` the claim's daemon, wait for it to exit, remove its directories (no daemon: just the latter).
        Without the binary a daemon whose pid is gone (or was never written) counts as stopped."""
        dirs = self.dirs(claim_uid)
        pid = self.pid(claim_uid)
        try:
            serving = self.running(claim_uid)
        except NotRun:
            if pid is not None and alive(pid):
                raise
            serving = False
        if serving:
            checked(self.runner, MPS_CONTROL, [], stdin="quit\n", env=dirs.env())
            if pid is not None and not _wait_gone(pid, STOP_WAIT_S):
                raise SharingError(
                    f"the MPS control daemon of claim {claim_uid} (pid {pid}) did not exit "
                    f"within {STOP_WAIT_S:g}s of quit"
                )
        shutil.rmtree(dirs.root, ignore_errors=True)


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.02)
    return False


def alive(pid: int) -> bool:
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
