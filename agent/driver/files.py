"""What the driver discovery found: files of one driver version, as paths relative to the driver root.

A relative path `usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04` is the same file for the agent (under
`--driver-root`), for the container runtime on the host (under `--host-driver-root`) and, as `/` + path, its
place inside the container: NVIDIA's generator mounts each file where the driver root has it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The compute and utility libraries a CUDA container needs (NVIDIA_DRIVER_CAPABILITIES compute,utility),
# by name stem, reported missing when absent. Every other library of the version is mounted too where present
# (`libnvidia-pkcs11*`, which only some drivers have, the graphics ones), as NVIDIA's generator does.
COMPUTE_LIBRARIES = (
    "libcuda",
    "libcudadebugger",
    "libnvidia-ml",
    "libnvidia-ptxjitcompiler",
    "libnvidia-nvvm",
    "libnvidia-opencl",
    "libnvidia-gpucomp",
    "libnvidia-cfg",
    "libnvidia-allocator",
)
BINARIES = (
    "nvidia-smi",
    "nvidia-debugdump",
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
)
SOCKETS = ("nvidia-persistenced/socket", "nvidia-fabricmanager/socket")  # under run/ (or var/run/)


@dataclass(frozen=True)
class Library:
    path: str  # relative to the driver root: usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
    soname: str | None  # libcuda.so.1; None when the file names none
    soname_link: bool = False  # the driver root has the soname symlink beside it (ldconfig made it)
    dev_link: bool = False  # ... and the unversioned `.so` link (the installer made it)

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def directory(self) -> str:
        return self.path.rsplit("/", 1)[0] if "/" in self.path else ""


@dataclass(frozen=True)
class File:
    """A binary, firmware file or socket: where the container sees it, and the real file behind it (the same
    unless the driver root reaches it through a symlink, which a runtime on the host could not follow)."""

    path: str  # relative to the driver root, e.g. usr/bin/nvidia-smi
    source: str  # relative to the driver root, symlinks resolved within it

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class DriverFiles:
    """One driver version's files under a driver root; empty tuples where nothing was found."""

    version: str
    libraries: tuple[Library, ...] = ()
    binaries: tuple[File, ...] = ()
    firmware: tuple[File, ...] = ()
    sockets: tuple[File, ...] = ()
    world_writable: tuple[str, ...] = ()  # mounted files anyone on the host may change (a warning, not left out)
    left_out: tuple[str, ...] = ()  # files whose name `nvidia-cdi-hook` arguments cannot carry (`unfit_name`)

    @property
    def library_dirs(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(lib.directory for lib in self.libraries))

    @property
    def missing(self) -> tuple[str, ...]:
        return missing_names(self)


# nvidia-cdi-hook takes `--link target::link` and `--folder path`, and splits a flag's value at commas (its
# CLI's string slices): a path holding one of these would be cut into other paths, or end a line early.
UNFIT_IN_HOOK_ARGS = ("::", ",", "\n", "\r")


def unfit_name(*paths: str | None) -> bool:
    """Whether any of `paths` holds something the hook's argument syntax cannot carry."""
    return any(bad in p for p in paths if p for bad in UNFIT_IN_HOOK_ARGS)


def library_stem(file_name: str) -> str:
    """`libcuda.so.580.159.04` -> `libcuda`."""
    return file_name.split(".so", 1)[0]


def dev_link_name(soname: str) -> str | None:
    """The unversioned link name of a library: `libcuda.so.1` -> `libcuda.so`; None without `.so`."""
    head, sep, _ = soname.partition(".so")
    return head + sep if sep else None


def missing_names(files: DriverFiles) -> tuple[str, ...]:
    """The expected compute libraries and binaries not among `files`, by name (firmware as one entry)."""
    stems = {library_stem(lib.name) for lib in files.libraries}
    binaries = {b.name for b in files.binaries}
    missing = [f"{stem}.so.{files.version}" for stem in COMPUTE_LIBRARIES if stem not in stems]
    missing += [name for name in BINARIES if name not in binaries]
    if not files.firmware:
        missing.append(f"firmware/nvidia/{files.version}/gsp*.bin")
    return tuple(missing)
