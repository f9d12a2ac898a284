"""The CDI container edits every claim's spec shares: the driver's files, mounted read-only, and the
`nvidia-cdi-hook` hooks that make them usable (pure: built once at start-up from what discovery found).

Paths: a file at `<rel>` under the driver root is mounted from `<host driver root>/<rel>` (the path the
container runtime, on the host, sees) to `/<rel>` in the container, as NVIDIA's generator does (its
transform/root "host" mode). Which hooks, and why, is in DESIGN.md ("Driver files in every claim's spec").
"""

from __future__ import annotations

import posixpath
import re
from typing import Any

from agent.driver.files import DriverFiles, Library

MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")
# A client connects to a unix socket by writing to it, which a read-only mount forbids.
SOCKET_OPTIONS = ("nosuid", "nodev", "bind", "noexec")
HOOK_STAGE = "createContainer"  # in the container's mount namespace, before pivot_root (CDI/OCI)


def host_path(host_root: str, relative: str) -> str:
    return posixpath.join("/", host_root, relative)


def container_path(relative: str) -> str:
    return "/" + relative


def _mount(host_root: str, path: str, source: str, options: tuple[str, ...] = MOUNT_OPTIONS) -> dict[str, Any]:
    return {"hostPath": host_path(host_root, source), "containerPath": container_path(path), "options": list(options)}


def symlinks(files: DriverFiles) -> list[str]:
    """`target::link` pairs for nvidia-cdi-hook create-symlinks: each library's SONAME link and unversioned
    `.so` link where the driver root has them (a container has no installer or ldconfig run to make them),
    and the links programs assume regardless (libcuda.so, as NVIDIA's generator adds)."""
    links: dict[str, None] = {}
    version = re.escape(files.version)
    for lib in files.libraries:
        folder = container_path(lib.directory)
        if re.fullmatch(rf"libcuda\.so\.{version}", lib.name):
            links[f"libcuda.so.1::{folder}/libcuda.so"] = None  # many programs dlopen("libcuda.so")
        elif re.fullmatch(rf"libnvidia-opticalflow\.so\.{version}", lib.name):
            links[f"libnvidia-opticalflow.so.1::{folder}/libnvidia-opticalflow.so"] = None
        elif re.fullmatch(rf"libGLX_nvidia\.so\.{version}", lib.name):
            links[f"{lib.name}::{folder}/libGLX_indirect.so.0"] = None  # GLVND's indirect GLX
        links.update(dict.fromkeys(_own_links(lib, folder)))
    return list(links)


def _own_links(lib: Library, folder: str) -> list[str]:
    out = []
    if lib.soname is not None and lib.soname != lib.name and lib.soname_link:
        out.append(f"{lib.name}::{folder}/{lib.soname}")
    target = lib.soname or lib.name
    dev = target.partition(".so")[0] + ".so"
    if dev != target and lib.dev_link:
        out.append(f"{target}::{folder}/{dev}")
    return out


def _hook(hook_path: str, command: str, *args: str) -> dict[str, Any]:
    return {"hookName": HOOK_STAGE, "path": hook_path, "args": [posixpath.basename(hook_path), command, *args]}


def hooks(files: DriverFiles, hook_path: str) -> list[dict[str, Any]]:
    """The hooks NVIDIA's generator adds for a compute container, in its order."""
    out = []
    if links := symlinks(files):
        out.append(_hook(hook_path, "create-symlinks", *(a for link in links for a in ("--link", link))))
    out.append(_hook(hook_path, "enable-cuda-compat", f"--host-driver-version={files.version}"))
    if files.library_dirs:
        folders = (a for d in files.library_dirs for a in ("--folder", container_path(d)))
        out.append(_hook(hook_path, "update-ldcache", *folders))
    out.append(_hook(hook_path, "disable-device-node-modification"))
    return out


def driver_edits(files: DriverFiles, host_root: str, hook_path: str | None) -> dict[str, Any]:
    """The containerEdits of the driver's files (no env, no device nodes: the claim's spec has those);
    empty when nothing was found."""
    mounts = [_mount(host_root, lib.path, lib.path) for lib in files.libraries]
    mounts += [_mount(host_root, f.path, f.source) for f in (*files.binaries, *files.firmware)]
    mounts += [_mount(host_root, f.path, f.source, SOCKET_OPTIONS) for f in files.sockets]
    edits: dict[str, Any] = {}
    if mounts:
        edits["mounts"] = mounts
    if hook_path is not None and files.libraries:
        edits["hooks"] = hooks(files, hook_path)
    return edits
