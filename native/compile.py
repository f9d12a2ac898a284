"""Compile the arbiter's core (`agent/arbiter/core`, pure and strictly typed) with mypyc, in place: the same
source, run as C. An extension module is imported ahead of a `.py` of the same name, so the compiled modules
must never be older than their source: old ones are removed first, and `make` rebuilds them whenever a source
changes (the test suite refuses to start on stale ones). Where no C compiler is at hand this fails and the
core runs interpreted, with the same decisions (tests/integration/test_core_compiled.py).

Run from the repository root: `python native/compile.py` (`make compiled`); `--clean` only removes them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "agent" / "arbiter" / "core"
GROUP = "agent.arbiter.core"  # its shared runtime becomes agent/arbiter/core__mypyc.*.so, inside the package


def sources() -> list[Path]:
    return sorted(p for p in PACKAGE.glob("*.py") if p.name != "__init__.py")


def compiled() -> list[Path]:
    """Every extension module a compile left in the tree (the core's and their shared runtime)."""
    return sorted([*PACKAGE.glob("*.so"), *PACKAGE.parent.glob("core__mypyc*.so")])


def clean() -> None:
    for path in compiled():
        path.unlink()


def main(argv: list[str]) -> int:
    clean()
    if argv == ["--clean"]:
        return 0
    from mypyc.build import mypycify
    from setuptools import setup

    os.chdir(ROOT)  # mypyc names modules after their paths, and writes its C under ./build
    modules = [str(p.relative_to(ROOT)) for p in sources()]
    setup(
        name="gpu-dra-agent-core",
        packages=[],
        script_args=["-q", "build_ext", "--inplace"],
        ext_modules=mypycify(modules, opt_level="3", group_name=GROUP),
    )
    for path in compiled():  # built from the sources as they are now (a copy from the build cache keeps its
        path.touch()  # old time, and the test suite compares these times with the sources')
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
