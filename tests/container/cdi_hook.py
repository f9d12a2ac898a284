"""NVIDIA's nvidia-cdi-hook, built from its Go module on first use into a cache outside the checkout.

    python -m tests.container.cdi_hook      (prints the binary's path)

Same rules as tests/controlplane/build.py, whose cache, lock and build helpers it uses: the cache directory is
named after the pinned version, builds are serialised by a file lock (parallel sessions share one build), a
budget bounds the wait and the build, and a killed build leaves no half directory. ~1 minute cold.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import IO

from tests.controlplane import build as cp
from tests.controlplane.build import BuildError, go_command
from tests.controlplane.build import BuildTimeout as BuildTimeout  # for callers: what build() raises past its budget

MODULE = "github.com/NVIDIA/nvidia-container-toolkit"
VERSION = "v1.20.2"
PACKAGE = f"{MODULE}/cmd/nvidia-cdi-hook@{VERSION}"
NAME = "nvidia-cdi-hook"


def cache_root() -> Path:
    return cp.cache_root().parent / "nvidia-cdi-hook"


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

    def steps(staging: Path, out: IO[str], deadline: float | None) -> None:
        command = [go, "install", "-trimpath", "-ldflags", "-s -w", PACKAGE]  # cgo: go-nvml needs it
        print(f"$ GOBIN={staging} {' '.join(command)}", file=out, flush=True)
        env = {"GOBIN": str(staging), "GOFLAGS": "-mod=mod"}
        code = cp.run_within(command, staging, out, deadline, budget_s, env)
        if code != 0 or not (staging / NAME).is_file():
            raise BuildError(f"`go install {PACKAGE}` failed with exit {code}; see {out.name}")

    return cp.build_once(binary_dir(), built, steps, budget_s=budget_s) / NAME


def main() -> int:
    try:
        print(build())
    except BuildError as error:
        print(f"{NAME}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
