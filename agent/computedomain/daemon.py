"""One ComputeDomain's IMEX daemon on this node: the driver root's `nvidia-imex`, run and watched by the agent.

Its files live in `<state-dir>/compute-domains/<domain uid>/`: `imexd.cfg`, `nodes.cfg` (the peers of this node's
clique), `imex.log` and `imex.pid`. When the peers change the nodes file is rewritten and the daemon started again
(NVIDIA's daemon does the same with IP addresses). Readiness is what `nvidia-imex-ctl -c imexd.cfg -q` says.

The daemon is the agent's child in a session of its own. The pid file lets an agent that was killed find the
daemon it left: on start it stops every daemon it finds there, and starts again those its prepared claims need.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence, Set
from pathlib import Path

from agent import files
from agent.computedomain import imexconfig
from agent.sharing.mps import alive

log = logging.getLogger(__name__)

IMEX = "nvidia-imex"
IMEX_CTL = "nvidia-imex-ctl"
STOP_GRACE_S = 5.0


class DaemonError(RuntimeError):
    """The daemon cannot be started; the message says why (a missing binary, an unwritable directory)."""


class DomainDaemon:
    def __init__(
        self,
        domain_uid: str,
        directory: Path,
        imex: Path,
        ctl: Path,
        *,
        bind_address: str,
        env: dict[str, str] | None = None,
    ) -> None:
        self.domain_uid = domain_uid
        self.directory = directory
        self.config = directory / "imexd.cfg"
        self.nodes_file = directory / "nodes.cfg"
        self.pid_file = directory / "imex.pid"
        self.imex = imex
        self.ctl = ctl
        self.bind_address = bind_address
        self.env = env
        self.peers: tuple[str, ...] = ()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, peers: Sequence[str]) -> None:
        for binary in (self.imex, self.ctl):
            if not os.access(binary, os.X_OK):
                raise DaemonError(
                    f"{binary} is not an executable: the driver root has no IMEX (driver 550+ for "
                    "GB200 installs nvidia-imex and nvidia-imex-ctl)"
                )
        self.directory.mkdir(parents=True, exist_ok=True)
        files.write_atomic(
            self.config, imexconfig.daemon_config(str(self.nodes_file), self.bind_address).encode(), durable=False
        )
        self._write_nodes(peers)
        self._spawn()

    def update(self, peers: Sequence[str]) -> bool:
        """Follow nodes joining and leaving: a new nodes file and a restart, only when the peers changed."""
        if tuple(peers) == self.peers and self.running():
            return False
        self._write_nodes(peers)
        self._terminate()
        self._spawn()
        return True

    def revive(self) -> bool:
        """Start it again if it died (NVIDIA's watchdog does the same); True when it had to."""
        if self.running():
            return False
        self._spawn()
        return True

    def check(self, timeout: float = 10.0) -> tuple[bool, str]:
        """(ready, what nvidia-imex-ctl said)."""
        try:
            done = subprocess.run(
                [str(self.ctl), "-c", str(self.config), "-q"],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self.env,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, str(exc)
        said = (done.stdout + done.stderr).strip() or f"exit {done.returncode}"
        return done.returncode == 0 and imexconfig.is_ready(done.stdout), said

    def stop(self) -> None:
        """Stop it for good: its directory goes too."""
        self._terminate()
        shutil.rmtree(self.directory, ignore_errors=True)

    def halt(self) -> None:
        """Stop it and keep its files (the agent stops; its claims still need the domain)."""
        self._terminate()

    # --- internals -----------------------------------------------------------------------------------------

    def _write_nodes(self, peers: Sequence[str]) -> None:
        files.write_atomic(self.nodes_file, imexconfig.nodes_config(peers).encode(), durable=False)
        self.peers = tuple(peers)

    def _spawn(self) -> None:
        with (self.directory / "imex.log").open("ab") as out:
            self._process = subprocess.Popen(
                [str(self.imex), "-c", str(self.config)],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        files.write_atomic(self.pid_file, f"{self._process.pid}\n".encode(), durable=False)
        log.info(
            "IMEX daemon started",
            extra={"domain_uid": self.domain_uid, "pid": self._process.pid, "peers": list(self.peers)},
        )

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        self.pid_file.unlink(missing_ok=True)


def stop_leftovers(root: Path, keep: Set[str] = frozenset()) -> list[str]:
    """Stop the IMEX daemons an earlier agent left under `root` (by their pid files, only if the process is still
    that daemon) and remove their directories, except those of the domains in `keep`, whose daemons are only
    stopped. Returns the domain UIDs found."""
    found: list[str] = []
    if not root.is_dir():
        return found
    running = _daemons_by_config()
    for directory in sorted(p for p in root.iterdir() if p.is_dir()):
        found.append(directory.name)
        pid_file = directory / "imex.pid"
        config = str(directory / "imexd.cfg")
        pids = set(running.get(config, ()))  # a daemon killed before its pid file was written has none
        with contextlib.suppress(OSError, ValueError):
            pids.add(int(pid_file.read_text()))
        for pid in sorted(pids):
            if _is_daemon_of(pid, directory / "imexd.cfg"):
                _kill(pid)
        pid_file.unlink(missing_ok=True)
        if directory.name not in keep:
            shutil.rmtree(directory, ignore_errors=True)
    return found


def _daemons_by_config() -> dict[str, list[int]]:
    """Live `nvidia-imex -c <config>` processes by config path (from /proc)."""
    out: dict[str, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = [a.decode(errors="replace") for a in (proc / "cmdline").read_bytes().split(b"\0")]
        except OSError:
            continue
        if len(argv) >= 3 and any(Path(a).name == IMEX for a in argv[:2]) and "-c" in argv:
            config = argv[argv.index("-c") + 1] if argv.index("-c") + 1 < len(argv) else ""
            out.setdefault(config, []).append(int(proc.name))
    return out


def _is_daemon_of(pid: int, config: Path) -> bool:
    """Whether `pid` still runs nvidia-imex with this config (not a process that reused the pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(config).encode() in argv


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while alive(pid):  # the MPS daemons' test: a zombie no one reaps has exited too
        if time.monotonic() >= deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.05)
