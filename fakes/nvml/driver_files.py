"""The files of a fake NVIDIA driver install: versioned libraries that are real ELF shared objects with the
driver's SONAMEs, their soname and `.so` links, the other binaries, GSP firmware and an ld.so.cache, laid
out as a host install or a driver folder, so agent.driver finds them as on a GPU node.

The libraries are minimal ELF64 shared objects written here (no toolchain needed): one PT_LOAD segment, a
PT_DYNAMIC with DT_SONAME/DT_STRTAB/DT_SYMTAB/DT_HASH, a non-executable PT_GNU_STACK. That is all `ldconfig`
reads, and `dlopen` loads them (they export nothing). The ld.so.cache is written in glibc's current format
(`glibc-ld.so.cache1.1`); glibc's own `ldconfig -p -C FILE` reads it.
"""

from __future__ import annotations

import os
import pathlib
import platform
import struct

VERSION = "550.54.15"  # what the fake NVML reports (fakes.nvml.machines.Machine.driver_version)
# name stem -> SONAME ("" = the versioned file name itself, as the real driver has for these)
LIBRARIES = {
    "libcuda": "libcuda.so.1",
    "libcudadebugger": "libcudadebugger.so.1",
    "libnvidia-ml": "libnvidia-ml.so.1",
    "libnvidia-ptxjitcompiler": "libnvidia-ptxjitcompiler.so.1",
    "libnvidia-nvvm": "libnvidia-nvvm.so.4",
    "libnvidia-opencl": "libnvidia-opencl.so.1",
    "libnvidia-gpucomp": "",
    "libnvidia-cfg": "libnvidia-cfg.so.1",
    "libnvidia-allocator": "libnvidia-allocator.so.1",
    "libnvidia-pkcs11-openssl3": "",
}
EXTRA_BINARIES = ("nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-server")
FIRMWARE = ("gsp_ga10x.bin", "gsp_tu10x.bin")

_MACHINES = {"x86_64": (62, "x86_64-linux-gnu", 0x0303), "aarch64": (183, "aarch64-linux-gnu", 0x0A03)}
EM, MULTIARCH, CACHE_FLAGS = _MACHINES.get(platform.machine(), _MACHINES["x86_64"])

# layout -> (library folder, binary folder) relative to the root; firmware is always lib/firmware.
LAYOUTS = {
    "host": (f"usr/lib/{MULTIARCH}", "usr/bin"),  # a distribution's packages, or the driver container's root
    "driver-folder": ("usr/local/nvidia/lib64", "usr/local/nvidia/bin"),  # lib64/ under a driver folder
}


def elf_shared_object(soname: str, machine: int = EM) -> bytes:
    """A minimal, loadable ELF64 little-endian shared object whose SONAME is `soname`."""
    strtab = b"\0" + soname.encode() + b"\0"
    symtab = bytes(24)  # the null symbol
    hashtab = struct.pack("<4I", 1, 1, 0, 0)  # nbucket, nchain, bucket[0], chain[0]
    phnum = 3
    at = 64 + phnum * 56
    str_off = at
    sym_off = _align(str_off + len(strtab), 8)
    hash_off = sym_off + len(symtab)
    dyn_off = _align(hash_off + len(hashtab), 8)
    dynamic = b"".join(
        struct.pack("<qQ", tag, value)
        for tag, value in (
            (14, 1),  # DT_SONAME: offset in DT_STRTAB
            (4, hash_off),  # DT_HASH
            (5, str_off),  # DT_STRTAB
            (6, sym_off),  # DT_SYMTAB
            (10, len(strtab)),  # DT_STRSZ
            (11, 24),  # DT_SYMENT
            (0, 0),  # DT_NULL
        )
    )
    size = dyn_off + len(dynamic)
    header = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)  # ELFCLASS64, little-endian, EV_CURRENT, SysV
    header += struct.pack("<HHIQQQIHHHHHH", 3, machine, 1, 0, 64, 0, 0, 64, 56, phnum, 64, 0, 0)
    phdrs = struct.pack("<IIQQQQQQ", 1, 6, 0, 0, 0, size, size, 0x1000)  # PT_LOAD RW, the whole file
    phdrs += struct.pack("<IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, len(dynamic), len(dynamic), 8)  # PT_DYNAMIC
    phdrs += struct.pack("<IIQQQQQQ", 0x6474E551, 6, 0, 0, 0, 0, 0, 16)  # PT_GNU_STACK RW (not executable)
    body = bytearray(size)
    body[: len(header)] = header
    body[64:at] = phdrs
    body[str_off : str_off + len(strtab)] = strtab
    body[sym_off : sym_off + len(symtab)] = symtab
    body[hash_off : hash_off + len(hashtab)] = hashtab
    body[dyn_off:size] = dynamic
    return bytes(body)


def _align(n: int, to: int) -> int:
    return n + (-n % to)


def ld_so_cache(entries: list[tuple[str, str]], flags: int = CACHE_FLAGS) -> bytes:
    """A `glibc-ld.so.cache1.1` file of (soname, path) entries, sorted as ldconfig sorts them (enough for a
    reader; the loader's binary search wants glibc's own order, which only lookups by name depend on)."""
    header_size, entry_size = 48, 24
    strings = bytearray()
    offsets = []
    base = header_size + entry_size * len(entries)
    for name, path in entries:
        key = base + len(strings)
        strings += name.encode() + b"\0"
        value = base + len(strings)
        strings += path.encode() + b"\0"
        offsets.append((key, value))
    out = bytearray(b"glibc-ld.so.cache1.1")
    out += struct.pack("<IIB3xI12x", len(entries), len(strings), 0, 0)
    for key, value in offsets:
        out += struct.pack("<iIIIQ", flags, key, value, 0, 0)
    return bytes(out + strings)


def install_driver_files(root: pathlib.Path, version: str = VERSION, layout: str = "host") -> pathlib.Path:
    """Write the driver's libraries (with links), the binaries other than the fake nvidia-smi and
    nvidia-cuda-mps-control, the firmware and `etc/ld.so.cache` under `root`; returns the library folder."""
    lib_dir, bin_dir = LAYOUTS[layout]
    libs = root / lib_dir
    libs.mkdir(parents=True, exist_ok=True)
    cache = []
    for stem, soname in LIBRARIES.items():
        name = f"{stem}.so.{version}"
        (libs / name).write_bytes(elf_shared_object(soname or name))
        if soname:
            _link(libs / soname, name)  # what ldconfig makes
        _link(libs / f"{stem}.so", soname or name)  # what the installer makes
        cache.append((soname or name, f"/{lib_dir}/{soname or name}"))
    binaries = root / bin_dir
    binaries.mkdir(parents=True, exist_ok=True)
    for name in EXTRA_BINARIES:
        (binaries / name).write_text(f"#!/bin/sh\necho 'fake {name} {version}'\n")
        (binaries / name).chmod(0o755)
    firmware = root / "lib/firmware/nvidia" / version
    firmware.mkdir(parents=True, exist_ok=True)
    for name in FIRMWARE:
        (firmware / name).write_bytes(b"fake GSP firmware\n")
    etc = root / "etc"
    (etc / "ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    if layout != "host":
        (etc / "ld.so.conf.d/nvidia.conf").write_text(f"/{lib_dir}\n")
    (etc / "ld.so.conf").write_text("include /etc/ld.so.conf.d/*.conf\n")
    (etc / "ld.so.cache").write_bytes(ld_so_cache(sorted(cache, reverse=True)))
    return libs


def _link(path: pathlib.Path, target: str) -> None:
    if path.is_symlink() or path.exists():
        path.unlink()
    os.symlink(target, path)
