"""Finding the driver's files under the driver root, once at start-up (the thin I/O edge of agent.driver).

What is looked for, and where, follows NVIDIA's generator (nvidia-container-toolkit v1.20.2,
pkg/nvcdi/driver-nvml.go, pkg/lookup, internal/lookup/root): every `lib*.so.<version>` of the exact version
NVML reports, through the driver root's own ld.so.cache and the standard library folders (a host install,
a driver container, the `lib64/` of a driver folder such as /usr/local/nvidia); the binaries on the usual
PATH folders; the GSP firmware under the kernel's firmware folders; the IPC sockets that exist. Paths inside
the root are resolved within it: an absolute symlink there points into the root, never at the agent's `/`.
Nothing missing is an error; a root that holds another driver version than NVML's is (DriverVersionMismatch).
A file whose path the hook's arguments cannot carry is left out, and world-writable files are named
(`DriverFiles.left_out`, `.world_writable`), for the start-up warnings.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import stat
import struct
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from agent.driver import elf, ldcache
from agent.driver.files import BINARIES, SOCKETS, DriverFiles, File, Library, dev_link_name, unfit_name

log = logging.getLogger(__name__)

LD_CACHE = "etc/ld.so.cache"
# NVIDIA's library locator's folders (pkg/lookup/library.go), plus a driver folder's lib64 (GKE, the
# `/usr/local/nvidia` layout), which the driver root's ld.so.cache usually names too.
LIBRARY_DIRS = (
    "usr/lib64",
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib/x86_64-linux-gnu/nvidia/current",
    "usr/lib/aarch64-linux-gnu/nvidia/current",
    "lib64",
    "lib/x86_64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "lib/x86_64-linux-gnu/nvidia/current",
    "lib/aarch64-linux-gnu/nvidia/current",
    "usr/local/nvidia/lib64",
)
# Where a binary is looked for (`find_binary`), in this order: the agent runs the driver's binaries
# (agent.sharing.commands) from the same place it mounts them into containers from.
BIN_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin", "usr/local/bin", "usr/local/sbin", "usr/local/nvidia/bin")
SOCKET_DIRS = ("run", "var/run")
FIRMWARE_CLASS_PATH = Path("/sys/module/firmware_class/parameters/path")
LEGACY_NVVM = re.compile(r"^libnvidia-nvvm70\.so\.\d+$")
_OTHER_VERSION = re.compile(r"^(libcuda|libnvidia-ml)\.so\.\d+\.\d+(\.\d+)?$")  # a driver version suffix
_MAX_LINKS = 40


class DriverVersionMismatch(Exception):
    """The driver root holds another driver than the one NVML (the loaded kernel module) reports."""


class DriverRootFs:
    """Paths inside a driver root, symlinks resolved as the root's own processes would see them."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._dirs: dict[str, str | None] = {}

    def resolve(self, path: str) -> str | None:
        """The real path of `path` (relative or absolute within the root), relative to the root; None when it
        does not exist or loops."""
        parts = [p for p in path.split("/") if p not in ("", ".")]
        if not parts:
            return ""
        parent = self._resolve_dir("/".join(parts[:-1]))
        if parent is None:
            return None
        return self._walk(parent, parts[-1:])

    def _resolve_dir(self, path: str) -> str | None:
        if path not in self._dirs:  # every library of a folder shares its resolution
            self._dirs[path] = self._walk("", [p for p in path.split("/") if p not in ("", ".")])
        return self._dirs[path]

    def _walk(self, start: str, parts: list[str]) -> str | None:
        done = start.split("/") if start else []
        pending = list(reversed(parts))
        links = 0
        while pending:
            part = pending.pop()
            if part == "..":
                if done:
                    done.pop()
                continue
            here = self.root.joinpath(*done, part)
            try:
                mode = os.lstat(here).st_mode
            except OSError:
                return None
            if stat.S_ISLNK(mode):
                links += 1
                if links > _MAX_LINKS:
                    return None
                target = os.readlink(here)
                if target.startswith("/"):
                    done = []
                pending.extend(reversed([p for p in target.split("/") if p not in ("", ".")]))
                continue
            done.append(part)
        return "/".join(done)

    def host(self, relative: str) -> Path:
        return self.root / relative

    def is_link(self, relative: str) -> bool:
        try:
            return stat.S_ISLNK(os.lstat(self.root / relative).st_mode)
        except OSError:
            return False

    def listdir(self, relative: str) -> list[str]:
        try:
            return sorted(os.listdir(self.root / relative))
        except OSError:
            return []


def discover(
    driver_root: Path,
    version: str,
    *,
    kernel_release: str | None = None,
    firmware_class_path: str | None = None,
) -> DriverFiles:
    """The files of driver `version` under `driver_root` (the root as the agent sees it). Raises
    DriverVersionMismatch when none of that version exists but another version's libcuda/libnvidia-ml does."""
    if not version:
        raise ValueError("the driver version NVML reports is empty")
    fs = DriverRootFs(driver_root)
    suffix = f".so.{version}"
    candidates: dict[str, None] = {}  # real relative paths, in discovery order
    others: set[str] = set()  # libcuda/libnvidia-ml of other versions, for the mismatch error
    for name, path in _library_paths(fs):
        if (name.endswith(suffix) or LEGACY_NVVM.match(name)) and (real := fs.resolve(path)) is not None:
            candidates.setdefault(real, None)
        elif _OTHER_VERSION.match(name):
            others.add(name)
    libraries = tuple(lib for path in sorted(candidates) if (lib := _library(fs, path)) is not None)
    if not any(not LEGACY_NVVM.match(lib.name) for lib in libraries) and others:
        raise DriverVersionMismatch(
            f"the driver root {driver_root} holds {', '.join(sorted(others))} but NVML reports driver {version}: "
            "its libraries belong to another driver than the loaded kernel module; point --driver-root at the "
            f"root of driver {version} (no libraries of another version are ever mounted)"
        )
    release = kernel_release if kernel_release is not None else os.uname().release
    custom = firmware_class_path if firmware_class_path is not None else _firmware_class_path()
    binaries, firmware, sockets = _binaries(fs), list(_firmware(fs, version, release, custom)), list(_sockets(fs))
    left_out = [lib.path for lib in libraries if unfit_name(lib.path, lib.soname)]
    left_out += [f.path for f in (*binaries, *firmware, *sockets) if unfit_name(f.path, f.source)]
    files = DriverFiles(
        version=version,
        libraries=tuple(lib for lib in libraries if lib.path not in left_out),
        binaries=tuple(f for f in binaries if f.path not in left_out),
        firmware=tuple(f for f in firmware if f.path not in left_out),
        sockets=tuple(f for f in sockets if f.path not in left_out),
        left_out=tuple(left_out),
    )
    return replace(files, world_writable=tuple(_world_writable(fs, files)))


def _world_writable(fs: DriverRootFs, files: DriverFiles) -> Iterator[str]:
    """The libraries, binaries and firmware files (their real files) that any user on the host may write:
    every container would run what such a user put there. Sockets are writable by design."""
    for path in [lib.path for lib in files.libraries] + [f.source for f in (*files.binaries, *files.firmware)]:
        try:
            if os.stat(fs.host(path)).st_mode & stat.S_IWOTH:
                yield path
        except OSError:
            continue


def _library_paths(fs: DriverRootFs) -> Iterator[tuple[str, str]]:
    """(file name, real relative path) of the libraries the root's ld.so.cache and library folders know:
    every file in a folder the cache names or a standard one, and, for NVIDIA's libraries, where the
    cache's soname link leads (a link may cross folders, as Debian's nvidia/current ones do). 64-bit only.
    Listing folders instead of resolving each of a host's ~1000 cache entries keeps start-up short."""
    folders: dict[str, None] = {}
    for entry in _cache_entries(fs):
        if not entry.is_64bit_elf:
            continue
        folders.setdefault(posixpath.dirname(entry.path), None)
        name = entry.name.lower()
        if ("nv" in name or "cuda" in name) and (real := fs.resolve(entry.path)) is not None:
            yield posixpath.basename(real), real
    seen: set[str] = set()
    for folder in (*folders, *LIBRARY_DIRS):
        real_dir = fs.resolve(folder)
        if real_dir is None or real_dir in seen:
            continue
        seen.add(real_dir)
        for name in fs.listdir(real_dir):
            if name.startswith("lib") and ".so." in name:
                yield name, f"{real_dir}/{name}" if real_dir else name


def _cache_entries(fs: DriverRootFs) -> list[ldcache.CacheEntry]:
    try:
        data = fs.host(LD_CACHE).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("cannot read the driver root's ld.so.cache, using the library folders only: %s", exc)
        return []
    try:
        return ldcache.parse(data)
    except ldcache.LdCacheError as exc:
        log.warning("the driver root's %s is unreadable (%s): using the library folders only", LD_CACHE, exc)
        return []


def _library(fs: DriverRootFs, path: str) -> Library | None:
    """The library at `path` if it is a 64-bit ELF shared object, with its SONAME and which links exist."""
    try:
        fd = os.open(fs.host(path), os.O_RDONLY)
        try:
            info = elf.read_info(lambda offset, size: os.pread(fd, size, offset))
        finally:
            os.close(fd)
    except (OSError, elf.ElfError, struct.error) as exc:
        log.debug("skipping %s: %s", path, exc)
        return None
    if info.bits != 64:
        return None
    directory, name = path.rsplit("/", 1) if "/" in path else ("", path)
    soname = info.soname
    target = soname or name
    dev = dev_link_name(target)
    return Library(
        path=path,
        soname=soname,
        soname_link=soname is not None and soname != name and fs.is_link(f"{directory}/{soname}"),
        dev_link=dev is not None and dev != target and fs.is_link(f"{directory}/{dev}"),
    )


def find_binary(fs: DriverRootFs, name: str) -> File | None:
    """The executable `name` in the root's BIN_DIRS, its path resolved within the root; None if none. The
    first ELF one wins: a wrapper script earlier in the folders (a GPU sandbox on an H200 had one at
    /usr/bin/nvidia-smi, before the driver's own in /usr/local/nvidia/bin) needs a shell and paths that a
    container lacks. Where no folder has an ELF one, the first executable is taken."""
    script = None
    for folder in BIN_DIRS:
        path = f"{folder}/{name}"
        real = fs.resolve(path)
        if real is None or not os.path.isfile(host := fs.host(real)) or not os.access(host, os.X_OK):
            continue
        if is_elf(host):
            return File(path, real)
        script = script or File(path, real)
    return script


def is_elf(path: Path) -> bool:
    """Whether the file at `path` starts as an ELF object does (False when it cannot be read)."""
    try:
        with path.open("rb") as file:
            return file.read(4) == elf.ELF_MAGIC
    except OSError:
        return False


def _binaries(fs: DriverRootFs) -> list[File]:
    return [found for name in BINARIES if (found := find_binary(fs, name)) is not None]


def _firmware_class_path() -> str:
    try:
        return FIRMWARE_CLASS_PATH.read_text().strip()
    except OSError:
        return ""


def firmware_dirs(release: str, custom: str) -> tuple[str, ...]:
    """The kernel's firmware search folders (drivers/base/firmware_loader), the custom one first."""
    dirs = [custom] if custom else []
    dirs += [f"lib/firmware/updates/{release}", "lib/firmware/updates", f"lib/firmware/{release}", "lib/firmware"]
    return tuple(d.strip("/") for d in dirs)


def _firmware(fs: DriverRootFs, version: str, release: str, custom: str) -> Iterator[File]:
    seen: set[str] = set()
    for folder in firmware_dirs(release, custom):
        path = f"{folder}/nvidia/{version}"
        real_dir = fs.resolve(path)
        if real_dir is None:
            continue
        for name in fs.listdir(real_dir):
            real = f"{real_dir}/{name}"
            if name.startswith("gsp") and name.endswith(".bin") and real not in seen and fs.host(real).is_file():
                seen.add(real)
                yield File(f"{path}/{name}", real)


def _sockets(fs: DriverRootFs) -> Iterable[File]:
    for name in SOCKETS:
        for folder in SOCKET_DIRS:
            path = f"{folder}/{name}"
            real = fs.resolve(path)
            if real is None:
                continue
            try:
                is_socket = stat.S_ISSOCK(os.stat(fs.host(real)).st_mode)
            except OSError:
                is_socket = False
            if is_socket:
                yield File(path, real)
                break


# Where NVIDIA's container toolkit installs the hook on a host: its packages, and the GPU Operator's toolkit.
DEFAULT_HOOK_PATHS = ("/usr/bin/nvidia-cdi-hook", "/usr/local/nvidia/toolkit/nvidia-cdi-hook")


def as_seen_by_agent(host_file: str, driver_root: Path, host_driver_root: str) -> Path:
    """Where the agent sees a host path: through `--driver-root` when it lies under the host driver root
    (the DaemonSet mounts that root there), else at the same path (mounted through as it is)."""
    relative = os.path.relpath(host_file, host_driver_root) if host_file.startswith("/") else ""
    if relative and not relative.startswith(".."):
        return Path(driver_root) / relative
    return Path(host_file)


def find_hook(driver_root: Path, host_driver_root: str, configured: str | None) -> str | None:
    """The host path of nvidia-cdi-hook for the specs: `configured`, or the first of NVIDIA's install paths,
    if the agent finds an executable there; None otherwise."""
    for candidate in [configured] if configured else DEFAULT_HOOK_PATHS:
        seen = as_seen_by_agent(candidate, driver_root, host_driver_root)
        if seen.is_file() and os.access(seen, os.X_OK):
            return candidate
    return None
