"""Build upstream's control plane from the Go modules beside this file into a cache outside the checkout.

    python -m tests.controlplane.build      (what `make control-plane` runs; prints the binary directory)

The cache directory is named after the pinned versions and a hash of the go.mod/go.sum files and the build
recipe, so a second run with nothing changed only checks that four files exist. Builds are serialised by a
file lock: parallel test sessions and worktrees on one machine share one build. Standard library only, so
make can run it before any virtualenv exists.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

MODULE_DIR = Path(__file__).resolve().parent
ETCD_MODULE_DIR = MODULE_DIR / "etcd"
INPUTS = (MODULE_DIR / "go.mod", MODULE_DIR / "go.sum", ETCD_MODULE_DIR / "go.mod", ETCD_MODULE_DIR / "go.sum")
KUBE_COMMANDS = ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
BINARIES = ("etcd", *KUBE_COMMANDS)
ETCD_MAIN = "go.etcd.io/etcd/server/v3"


class BuildError(RuntimeError):
    """The toolchain is missing or `go build` failed; the message says which and where the log is."""


class BuildTimeout(BuildError):
    """The build did not finish within its time budget (it was stopped; Go's caches keep what was compiled)."""


def _required(go_mod: Path, module: str) -> str:
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(module)}\s+(v\S+)", go_mod.read_text(), re.MULTILINE)
    if not found:
        raise BuildError(f"{go_mod} does not require {module}")
    return found.group(1)


def kubernetes_version() -> str:
    return _required(MODULE_DIR / "go.mod", "k8s.io/kubernetes")


def etcd_version() -> str:
    return _required(ETCD_MODULE_DIR / "go.mod", ETCD_MAIN)


def _ldflags() -> str:
    """Stamp the version the binaries report (`/version`, `--version`) as a release build would.

    Without it kube-apiserver reports v0.0.0-master, and clients that pick behaviour by server version (the
    agent does, for slice shapes) would see a version that is no release.
    """
    version = kubernetes_version()
    major, minor = version.lstrip("v").split(".")[:2]
    flags = ["-s", "-w"]
    for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {package}.gitVersion={version}",
            f"-X {package}.gitMajor={major}",
            f"-X {package}.gitMinor={minor}",
            f"-X {package}.gitTreeState=clean",
        ]
    return " ".join(flags)


def cache_root() -> Path:
    base = os.environ.get("GPU_DRA_AGENT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpu-dra-agent"
    )
    return Path(base) / "control-plane"


def binary_dir() -> Path:
    """Where the binaries for the pinned versions live (whether or not they are built yet)."""
    digest = hashlib.sha256(_ldflags().encode())
    for path in INPUTS:
        digest.update(path.read_bytes())
    return cache_root() / f"kubernetes-{kubernetes_version()}-etcd-{etcd_version()}-{digest.hexdigest()[:12]}"


def built() -> Path | None:
    directory = binary_dir()
    return directory if all((directory / name).is_file() for name in BINARIES) else None


def go_command() -> str | None:
    return shutil.which("go")


def build(log: Path | None = None, budget_s: float | None = None) -> Path:
    """The binary directory, building it first if needed (minutes cold, a file check warm).

    `budget_s` bounds the whole build, waiting for another session's build included: past it the build is
    stopped and BuildTimeout raised, so a slow machine costs a bounded time rather than a CI timeout.
    """
    ready = built()
    if ready:
        return ready
    go = go_command()
    if go is None:
        raise BuildError("`go` is not on PATH: building kube-apiserver 1.37 and etcd needs Go 1.26")

    def steps(staging: Path, out: IO[str], deadline: float | None) -> None:
        commands = [f"k8s.io/kubernetes/cmd/{c}" for c in KUBE_COMMANDS]
        _go_build(go, MODULE_DIR, commands, staging, out, deadline, budget_s)
        _go_build(go, ETCD_MODULE_DIR, [ETCD_MAIN], staging / "etcd", out, deadline, budget_s)

    return build_once(binary_dir(), built, steps, log, budget_s)


def build_once(
    target: Path,
    ready: Callable[[], Path | None],
    steps: Callable[[Path, IO[str], float | None], None],
    log: Path | None = None,
    budget_s: float | None = None,
) -> Path:
    """`target`, made by `steps(staging, log, deadline)` under the cache's file lock unless `ready()` finds it there.

    Shared by every Go build the tests cache (control plane, node stack, nvidia-cdi-hook): another session may
    be building the same thing, so the lock is waited for (within `budget_s`) and `ready()` asked again; the
    steps write into a staging directory renamed to `target` whole, so a killed build leaves no half directory.
    """
    deadline = None if budget_s is None else time.monotonic() + budget_s
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        _lock(lock, deadline, budget_s)  # another session may be building the same thing: wait for it
        if ready() is not None:
            return target
        log = log or target.parent / f"{target.name}.build.log"
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
        try:
            with open(log, "w") as out:
                steps(staging, out, deadline)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)  # whole or not at all
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _lock(lock: IO[str], deadline: float | None, budget_s: float | None) -> None:
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (fcntl.LOCK_NB if deadline is not None else 0))
            return
        except BlockingIOError:
            if deadline is not None and time.monotonic() > deadline:
                raise BuildTimeout(f"another build held the lock past the {budget_s:.0f}s budget") from None
            time.sleep(1)


def _go_build(
    go: str,
    module: Path,
    packages: list[str],
    output: Path,
    out: IO[str],
    deadline: float | None = None,
    budget_s: float | None = None,
    *,
    ldflags: str | None = None,
    tags: str = "",
    env: dict[str, str] | None = None,
) -> None:
    if ldflags is None:
        ldflags = _ldflags() if module == MODULE_DIR else "-s -w"
    command = [
        go,
        "build",
        "-trimpath",
        "-buildvcs=false",
        "-mod=readonly",
        "-ldflags",
        ldflags,
        *(["-tags", tags] if tags else []),
        "-o",
        f"{output}{os.sep}" if len(packages) > 1 else str(output),
        *packages,
    ]
    print(f"$ (cd {module} && {' '.join(command)})", file=out, flush=True)
    returncode = run_within(command, module, out, deadline, budget_s, env)
    if returncode != 0:
        raise BuildError(f"`go build` in {module} failed with exit {returncode}; see {out.name}")


def run_within(
    command: list[str],
    cwd: Path,
    out: IO[str],
    deadline: float | None,
    budget_s: float | None,
    env: dict[str, str] | None = None,
) -> int:
    """`command`'s exit status, its output in `out`; stopped (with every process it started) and BuildTimeout
    raised past `deadline`."""
    started = time.monotonic()
    # A session of its own, so a stop takes the compilers and linkers go started with it.
    process = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    try:
        returncode = process.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        print(f"# stopped after {time.monotonic() - started:.0f}s: over the build budget", file=out, flush=True)
        raise BuildTimeout(f"the build did not finish within its {budget_s:.0f}s budget; see {out.name}") from None
    except BaseException:  # interrupted: do not leave a compile running behind us
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        raise
    print(f"# exit {returncode} after {time.monotonic() - started:.0f}s", file=out, flush=True)
    return returncode


def main() -> int:
    if built() is None:
        print(
            f"building kube-apiserver, kube-scheduler, kube-controller-manager {kubernetes_version()} and "
            f"etcd {etcd_version()} (cold: many minutes; log beside {binary_dir()})",
            file=sys.stderr,
        )
    try:
        print(build())
    except BuildError as error:
        print(f"control-plane: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
