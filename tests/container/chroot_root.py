"""A container root built from a CDI spec alone, without a container engine: what the issue's GPU check does.

`run_in_spec_root` makes an empty root, binds into it, read-only, every mount and device node of the spec (in
a mount namespace of its own, `unshare -m`, so nothing outlives the run), does what the spec's
`nvidia-cdi-hook` hooks would (the soname links of create-symlinks, update-ldcache's loader cache, the
`ModifyDeviceFiles: 0` params file of disable-device-node-modification), adds a program and the C library
(glibc) that it and the driver's files link, as any base image would, and runs the program chrooted. Needs
root, util-linux `unshare`, and `ldconfig`.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import shutil
import subprocess
from typing import Any

from agent.driver.discovery import is_elf

PARAMS = pathlib.Path("/proc/driver/nvidia/params")


def missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "building a root with bind mounts and chroot needs root"
    for tool in ("unshare", "mount", "chroot", "ldconfig", "ldd", "gcc"):
        if shutil.which(tool) is None and not os.access(f"/sbin/{tool}", os.X_OK):
            return f"{tool} is not installed"
    return None


def compile_program(source: str, out: pathlib.Path) -> pathlib.Path:
    (out.parent / "program.c").write_text(source)
    subprocess.run(["gcc", "-O1", "-o", str(out), str(out.parent / "program.c"), "-ldl"], check=True)
    return out


# glibc's own files: every base image has them, and a CDI spec rightly leaves them out
C_LIBRARY = re.compile(r"^(ld-linux[\w.-]*|lib(c|m|dl|pthread|rt|resolv|util|mvec)\.so[\d.]*)$")


def _c_library(elves: list[str]) -> list[str]:
    """The C library's files (libc, libm, ..., the loader) that `elves` link, as ldd names them. Only glibc's:
    a driver library the spec forgot must stay missing in the root, not be borrowed from the host."""
    found: dict[str, None] = {}
    for elf in elves:
        printed = subprocess.run(["ldd", elf], capture_output=True, text=True, check=False).stdout
        for line in printed.splitlines():
            words = line.split()
            path = words[2] if "=>" in words and len(words) > 2 else words[0] if words else ""
            if path.startswith("/") and C_LIBRARY.match(os.path.basename(path)):
                found.setdefault(path, None)
    return list(found)


def _elves(spec: dict[str, Any]) -> list[str]:
    """The spec's mounted files that are ELF objects (the driver's libraries and binaries)."""
    mounts = (m for edits in _all_edits(spec) for m in edits.get("mounts") or ())
    return [m["hostPath"] for m in mounts if is_elf(pathlib.Path(m["hostPath"]))]


def _all_edits(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in spec["devices"]]


def run_in_spec_root(
    spec: dict[str, Any], workdir: pathlib.Path, argv: list[str], program: pathlib.Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `argv` chrooted in a root made of `spec` (plus `program` at /program, if given)."""
    root = workdir / "root"
    root.mkdir(parents=True)
    for folder in ("etc", "tmp", "proc", "sys", "dev"):
        (root / folder).mkdir(exist_ok=True)
    lines = ["set -e", "mount --make-rprivate /"]

    def bind(source: str, target: str, options: str = "ro") -> None:
        path = root / target.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        if os.path.isdir(source):
            path.mkdir(exist_ok=True)
        else:
            path.touch(exist_ok=True)
        lines.append(f"mount --bind {shlex.quote(source)} {shlex.quote(str(path))}")
        if options:
            lines.append(f"mount -o remount,bind,{options} {shlex.quote(str(path))}")

    for edits in _all_edits(spec):
        for m in edits.get("mounts") or ():
            writable = "ro" not in m.get("options", ())
            bind(m["hostPath"], m["containerPath"], "" if writable else "ro,nosuid,nodev")
        for n in edits.get("deviceNodes") or ():
            bind(n.get("hostPath", n["path"]), n["path"], "")
    for lib in _c_library(_elves(spec) + ([str(program)] if program is not None else [])):
        bind(lib, lib)
    if program is not None:
        bind(str(program), "/program")
    lines.append(f"mount -t proc proc {shlex.quote(str(root / 'proc'))}")
    lines.append(f"mount --rbind /sys {shlex.quote(str(root / 'sys'))}")
    folders = []
    for edits in _all_edits(spec):
        for hook in edits.get("hooks") or ():
            args = hook["args"][1:]
            if args[0] == "create-symlinks":
                for link in args[2::2]:
                    target, path = link.split("::", 1)
                    (root / path.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                    os.symlink(target, root / path.lstrip("/"))
            elif args[0] == "update-ldcache":
                folders += args[2::2]
            elif args[0] == "disable-device-node-modification" and PARAMS.is_file():
                params = workdir / "params"
                params.write_text(PARAMS.read_text().replace("ModifyDeviceFiles: 1", "ModifyDeviceFiles: 0"))
                lines.append(f"mount --bind {params} {shlex.quote(str(root / 'proc/driver/nvidia/params'))}")
    (root / "etc/ld.so.conf").write_text("".join(f"{f}\n" for f in folders))
    lines.append(f"ldconfig -r {shlex.quote(str(root))}")
    lines.append("exec chroot " + shlex.quote(str(root)) + " " + " ".join(shlex.quote(a) for a in argv))
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", "\n".join(lines)], capture_output=True, text=True, timeout=120, check=False
    )


CUDA_PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
int main(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (!cuda) { printf("dlopen failed: %s\n", dlerror()); return 2; }
    printf("dlopen libcuda.so.1: ok\n");
    int (*init)(unsigned) = (int (*)(unsigned))dlsym(cuda, "cuInit");
    int (*count)(int *) = (int (*)(int *))dlsym(cuda, "cuDeviceGetCount");
    if (!init || !count) { printf("no cuInit/cuDeviceGetCount\n"); return 3; }
    int rc = init(0), n = -1;
    printf("cuInit: %d\n", rc);
    if (rc != 0) return 4;
    rc = count(&n);
    printf("cuDeviceGetCount: %d devices=%d\n", rc, n);
    return rc == 0 ? 0 : 5;
}
"""
