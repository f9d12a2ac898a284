"""Build the node side of a real cluster from the Go modules beside this file into a cache outside the checkout.

    python -m tests.node.build      (what `make node-stack` runs; prints the binary directory)

kubelet (k8s.io/kubernetes, the control plane's release), containerd with its CRI plugin, ctr and the runc
shim, runc, the CNI plugins bridge/host-local/loopback/portmap and crictl, each pinned in a go.mod of its own
(one build list per upstream project, so no project's dependencies lift another's). Same cache, lock and
budget logic as the control plane (tests/controlplane/build.py): the directory is named after the versions
and a hash of every go.mod/go.sum and the recipe, a file lock serialises builds, and a budget stops a build
that would run past it. Standard library only, so make can run it before any virtualenv exists.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.controlplane import build as cp

NODE_DIR = Path(__file__).resolve().parent
SECCOMP_HEADER = Path("/usr/include/seccomp.h")


@dataclass(frozen=True)
class Part:
    """One go.mod under tests/node and what is built from it."""

    directory: str
    module: str  # the upstream module whose version names the cache
    packages: tuple[str, ...]
    binaries: tuple[str, ...]
    tags: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return NODE_DIR / self.directory

    def version(self) -> str:
        return cp._required(self.path / "go.mod", self.module)

    def ldflags(self) -> str:
        if self.directory == "kubelet":  # `kubelet --version` and the Node's kubeletVersion: a release, not master
            if self.version() != cp.kubernetes_version():  # the stamp is the control plane's release
                raise cp.BuildError(
                    f"{self.path / 'go.mod'} pins k8s.io/kubernetes {self.version()}, the control "
                    f"plane {cp.kubernetes_version()}: move them together"
                )
            return cp._ldflags()
        if self.directory == "containerd":
            return f"-s -w -X github.com/containerd/containerd/v2/version.Version={self.version()}"
        if self.directory == "runc":
            return f"-s -w -X main.version={self.version().lstrip('v')}"
        return "-s -w"


CONTAINERD_COMMANDS = ("containerd", "ctr", "containerd-shim-runc-v2")
PARTS = (
    # seccomp: containerd's CRI gives containers a seccomp profile, which a runc built without it refuses
    # ("config provided but seccomp not supported"); needs cgo and libseccomp's headers.
    Part(
        "runc",
        "github.com/opencontainers/runc",
        ("github.com/opencontainers/runc",),
        ("runc",),
        tags="seccomp",
        env={"CGO_ENABLED": "1"},
    ),
    Part(
        "containerd",
        "github.com/containerd/containerd/v2",
        tuple(f"github.com/containerd/containerd/v2/cmd/{c}" for c in CONTAINERD_COMMANDS),
        CONTAINERD_COMMANDS,
        tags="no_btrfs no_devmapper no_zfs",
        env={"CGO_ENABLED": "0"},
    ),
    Part(
        "cni",
        "github.com/containernetworking/plugins",
        tuple(
            f"github.com/containernetworking/plugins/plugins/{p}"
            for p in ("main/bridge", "ipam/host-local", "main/loopback", "meta/portmap")
        ),
        ("bridge", "host-local", "loopback", "portmap"),
        env={"CGO_ENABLED": "0"},
    ),
    Part(
        "crictl", "sigs.k8s.io/cri-tools", ("sigs.k8s.io/cri-tools/cmd/crictl",), ("crictl",), env={"CGO_ENABLED": "0"}
    ),
    Part("kubelet", "k8s.io/kubernetes", ("k8s.io/kubernetes/cmd/kubelet",), ("kubelet",)),
)
BINARIES = tuple(name for part in PARTS for name in part.binaries)


def versions() -> dict[str, str]:
    return {part.directory: part.version() for part in PARTS}


def cache_root() -> Path:
    return cp.cache_root().parent / "node-stack"


def binary_dir() -> Path:
    """Where the binaries for the pinned versions live (whether or not they are built yet)."""
    digest = hashlib.sha256()
    for part in PARTS:
        digest.update(repr((part.packages, part.tags, sorted(part.env.items()), part.ldflags())).encode())
        digest.update((part.path / "go.mod").read_bytes())
        digest.update((part.path / "go.sum").read_bytes())
    names = "-".join(f"{p.directory}-{p.version()}" for p in PARTS if p.directory in ("kubelet", "containerd", "runc"))
    return cache_root() / f"{names}-{digest.hexdigest()[:12]}"


def built() -> Path | None:
    directory = binary_dir()
    return directory if all((directory / name).is_file() for name in BINARIES) else None


def missing_prerequisite() -> str | None:
    """Why the build cannot start here (beyond Go itself), or None."""
    if cp.go_command() is None:
        return "`go` (1.26) is not on PATH to build kubelet, containerd and runc (`make node-stack`)"
    if shutil.which("gcc") is None:
        return "runc is built with cgo (seccomp) and needs a C compiler: apt-get install gcc libseccomp-dev"
    if not SECCOMP_HEADER.exists():
        return f"runc is built with seccomp and needs {SECCOMP_HEADER}: apt-get install libseccomp-dev"
    return None


def build(log: Path | None = None, budget_s: float | None = None) -> Path:
    """The binary directory, building it first if needed (minutes cold, a file check warm)."""
    ready = built()
    if ready:
        return ready
    go = cp.go_command()
    why = missing_prerequisite()
    if go is None or why:
        raise cp.BuildError(why or "go is missing")

    def steps(staging: Path, out: IO[str], deadline: float | None) -> None:
        for part in PARTS:
            output = staging / part.binaries[0] if len(part.packages) == 1 else staging
            cp._go_build(
                go,
                part.path,
                list(part.packages),
                output,
                out,
                deadline,
                budget_s,
                ldflags=part.ldflags(),
                tags=part.tags,
                env=part.env,
            )

    return cp.build_once(binary_dir(), built, steps, log, budget_s)


def main() -> int:
    if built() is None:
        pinned = ", ".join(f"{name} {version}" for name, version in versions().items())
        print(f"building the node stack: {pinned} (cold: minutes; log beside {binary_dir()})", file=sys.stderr)
    try:
        print(build())
    except cp.BuildError as error:
        print(f"node-stack: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
