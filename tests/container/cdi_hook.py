"""NVIDIA's nvidia-cdi-hook, built from its Go module on first use into a cache outside the checkout.

    python -m tests.container.cdi_hook      (prints the binary's path)

Same rules as tests/controlplane/build.py, whose lock and build helpers it uses: the cache directory is named
after the pinned version, builds are serialised by a file lock (parallel sessions share one build), a
budget bounds the wait and the build, and a killed build leaves no half directory. ~1 minute cold.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.controlplane.build import BuildError, BuildTimeout, _lock, go_command

MODULE = "github.com/NVIDIA/nvidia-container-toolkit"
VERSION = "v1.20.2"
PACKAGE = f"{MODULE}/cmd/nvidia-cdi-hook@{VERSION}"
NAME = "nvidia-cdi-hook"


def cache_root() -> Path:
    base = os.environ.get("GPU_DRA_AGENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpu-dra-agent"
    )
    return Path(base) / "nvidia-cdi-hook"


def binary_dir() -> Path:
    return cache_root() / f"nvidia-container-toolkit-{VERSION}"


def built() -> Path | None:
    path = binary_dir() / NAME
    return path if path.is_file() else None


def build(budget_s: float | None = None) -> Path:
    """The hook's path, building it first if needed. Raises BuildError (no Go, build failed) or BuildTimeout."""
    if (ready := built()) is not None:
        return ready
    go = go_command()
    if go is None:
        raise BuildError(f"`go` is not on PATH: building {NAME} {VERSION} needs Go")
    deadline = None if budget_s is None else time.monotonic() + budget_s
    target = binary_dir()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        _lock(lock, deadline, budget_s)
        if (ready := built()) is not None:
            return ready
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        log = target.parent / f"{target.name}.build.log"
        try:
            with open(log, "w") as out:
                command = [go, "install", "-trimpath", "-ldflags", "-s -w", PACKAGE]  # cgo: go-nvml needs it
                print(f"$ GOBIN={staging} {' '.join(command)}", file=out, flush=True)
                process = subprocess.Popen(command, cwd=staging, stdout=out, stderr=subprocess.STDOUT,
                                           env={**os.environ, "GOBIN": str(staging), "GOFLAGS": "-mod=mod"},
                                           start_new_session=True)  # fmt: skip
                try:
                    code = process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, 9)
                    process.wait()
                    raise BuildTimeout(f"building {NAME} did not finish within {budget_s:.0f}s; see {log}") from None
            if code != 0 or not (staging / NAME).is_file():
                raise BuildError(f"`go install {PACKAGE}` failed with exit {code}; see {log}")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target / NAME


def main() -> int:
    try:
        print(build())
    except BuildError as error:
        print(f"{NAME}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
