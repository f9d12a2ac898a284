"""The one place the agent runs NVIDIA's binaries: argv lists, found under the driver root.

The driver root is where the host's NVIDIA driver is installed (NVIDIA's `nvidiaDriverRoot`): `/` on
most nodes, e.g. `/run/nvidia/driver` when the GPU Operator's driver container provides it. Binaries are
looked up in its bin directories (with the root `/`, on PATH first); libraries beside them are put on the
loader path when the root is not `/`. Nothing here goes through a shell.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.driver.discovery import BIN_DIRS, LIBRARY_DIRS, DriverRootFs, find_binary

# The folders driver discovery looks in (a driver folder's lib64 too, beside its bin that `find` searches),
# and usr/lib, where some distributions put 64-bit libraries.
LIB_DIRS = (*LIBRARY_DIRS, "usr/lib")
TIMEOUT_S = 30.0


class SharingError(Exception):
    """Applying or undoing a claim's sharing failed; the message says what and why."""


class NotRun(SharingError):
    """The binary could not be found or started: it changed nothing."""


class CommandFailed(SharingError):
    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


@dataclass(frozen=True)
class Completed:
    returncode: int
    stdout: str
    stderr: str


class CommandRunner(Protocol):
    """Runs one NVIDIA binary by name; tests substitute their own."""

    def run(
        self, binary: str, args: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> Completed:
        """Run `binary` with `args`; raises NotRun when it cannot be found or started, SharingError when it
        does not finish."""
        ...


class DriverRoot:
    """Finds binaries of the NVIDIA driver installed under `root`."""

    def __init__(self, root: Path | str = "/") -> None:
        self.root = Path(root)

    @property
    def is_host_root(self) -> bool:
        return self.root == Path("/")

    def find(self, binary: str) -> str:
        """The binary's path as the agent runs it: on PATH with the root `/`, else as driver discovery finds
        it (agent.driver.discovery.find_binary: the same folders, symlinks resolved within the root)."""
        if self.is_host_root and (found := shutil.which(binary)):
            return found
        if (file := find_binary(DriverRootFs(self.root), binary)) is not None:
            return str(self.root / file.source)
        raise NotRun(f"{binary} not found under driver root {self.root} (looked in {self.searched()})")

    def searched(self) -> str:
        """Where `find` looks, for a message."""
        return ("PATH, " if self.is_host_root else "") + ", ".join(str(self.root / d) for d in BIN_DIRS)

    def library_path(self) -> str | None:
        """LD_LIBRARY_PATH for binaries of a driver root that is not `/` (their libnvidia-ml is there)."""
        if self.is_host_root:
            return None
        dirs = [str(self.root / d) for d in LIB_DIRS if (self.root / d).is_dir()]
        return ":".join(dirs) or None


class SubprocessRunner:
    """Runs binaries of a driver root as child processes, with the agent's environment plus `env`."""

    def __init__(self, driver_root: DriverRoot, timeout_s: float = TIMEOUT_S) -> None:
        self.driver_root = driver_root
        self.timeout_s = timeout_s

    def run(
        self, binary: str, args: Sequence[str], *, stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> Completed:
        argv = [self.driver_root.find(binary), *args]
        full_env = {**os.environ, **(env or {})}
        if (libs := self.driver_root.library_path()) is not None:
            full_env["LD_LIBRARY_PATH"] = libs + (
                ":" + full_env["LD_LIBRARY_PATH"] if "LD_LIBRARY_PATH" in full_env else ""
            )
        try:
            done = subprocess.run(  # an argv list of a binary found under the driver root, no shell
                argv,
                input=stdin if stdin is not None else "",
                capture_output=True,
                text=True,
                env=full_env,
                timeout=self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise SharingError(f"{' '.join(argv)} did not finish within {self.timeout_s:g}s") from exc
        except OSError as exc:
            raise NotRun(f"cannot run {argv[0]}: {exc.strerror}") from exc
        return Completed(done.returncode, done.stdout, done.stderr)


def checked(
    runner: CommandRunner,
    binary: str,
    args: Sequence[str],
    *,
    stdin: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Completed:
    """Run and raise CommandFailed (with the tool's own words) unless it exits 0."""
    done = runner.run(binary, args, stdin=stdin, env=env)
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        shown = " ".join([binary, *args]) + (f" <<< {stdin.strip()!r}" if stdin else "")
        raise CommandFailed(f"{shown} failed (exit {done.returncode}): {said}", done.returncode)
    return done
