"""Build helm (helm.sh/helm/v4, pinned in the go.mod beside this file) into a cache outside the checkout.

    python -m tests.helm.build      (prints the binary's path)

Same cache, lock and budget logic as the control plane (tests/controlplane/build.py): the directory is named
after the version and a hash of go.mod/go.sum and the recipe. Standard library only.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import IO

from tests.controlplane import build as cp

MODULE_DIR = Path(__file__).resolve().parent
MODULE = "helm.sh/helm/v4"


def version() -> str:
    return cp._required(MODULE_DIR / "go.mod", MODULE)


def _ldflags() -> str:  # `helm version` says the release, not the module's default "v4.3"
    return f"-s -w -X {MODULE}/internal/version.version={version()} -X {MODULE}/internal/version.gitTreeState=clean"


def binary() -> Path:
    """Where helm for the pinned version lives (whether or not it is built yet)."""
    digest = hashlib.sha256(_ldflags().encode())
    for name in ("go.mod", "go.sum"):
        digest.update((MODULE_DIR / name).read_bytes())
    return cp.cache_root().parent / "helm" / f"helm-{version()}-{digest.hexdigest()[:12]}" / "helm"


def built() -> Path | None:
    return binary().parent if binary().is_file() else None


def build(log: Path | None = None, budget_s: float | None = None) -> Path:
    """The helm binary, building it first if needed (about a minute cold with a warm Go module cache)."""
    if built():
        return binary()
    go = cp.go_command()
    if go is None:
        raise cp.BuildError("`go` (1.26) is not on PATH to build helm")

    def steps(staging: Path, out: IO[str], deadline: float | None) -> None:
        cp._go_build(
            go,
            MODULE_DIR,
            [f"{MODULE}/cmd/helm"],
            staging / "helm",
            out,
            deadline,
            budget_s,
            ldflags=_ldflags(),
            env={"CGO_ENABLED": "0"},
        )

    cp.build_once(binary().parent, built, steps, log, budget_s)
    return binary()


def main() -> int:
    try:
        print(build())
    except cp.BuildError as error:
        print(f"helm: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
