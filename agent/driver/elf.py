"""The SONAME of an ELF shared object, read from its dynamic section (pure: a reader of the file's bytes in).

The loader and ldconfig find a library by its SONAME (`libcuda.so.1`), not its file name
(`libcuda.so.580.159.04`), so the links a container needs are named after it. Only what that needs is read:
the ELF header, the program headers, the PT_DYNAMIC entries, and the string table DT_STRTAB points at
(through the PT_LOAD segment that maps it).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

ELF_MAGIC = b"\x7fELF"
ELFCLASS32, ELFCLASS64 = 1, 2
ELFDATA2LSB, ELFDATA2MSB = 1, 2
ET_DYN = 3
PT_LOAD, PT_DYNAMIC = 1, 2
DT_NULL, DT_STRTAB, DT_SONAME = 0, 5, 14

Reader = Callable[[int, int], bytes]  # (offset, size) -> the bytes there (fewer at the end of the file)


class ElfError(ValueError):
    """Not an ELF shared object this reader can take a SONAME from."""


class ElfInfo:
    """What the driver discovery needs of one library: its class and SONAME (None when it has none)."""

    __slots__ = ("bits", "soname")

    def __init__(self, bits: int, soname: str | None) -> None:
        self.bits = bits
        self.soname = soname


def from_bytes(data: bytes) -> Reader:
    return lambda offset, size: data[offset : offset + size]


def read_info(read: Reader) -> ElfInfo:
    """Class and SONAME of the shared object `read` reads (the dynamic section of a large library, libc's or
    libcuda's, lies megabytes in: only the few parts needed are read)."""
    ident = read(0, 64)
    if len(ident) < 20 or ident[:4] != ELF_MAGIC:
        raise ElfError("not an ELF file")
    klass, order = ident[4], ident[5]
    if klass not in (ELFCLASS32, ELFCLASS64) or order not in (ELFDATA2LSB, ELFDATA2MSB):
        raise ElfError(f"unknown ELF class {klass} or byte order {order}")
    e = "<" if order == ELFDATA2LSB else ">"
    wide = klass == ELFCLASS64
    if struct.unpack_from(e + "H", ident, 16)[0] != ET_DYN:
        raise ElfError("not a shared object (e_type is not ET_DYN)")
    header = struct.Struct(e + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"))
    if len(ident) < 16 + header.size:
        raise ElfError("truncated ELF header")
    _, _, _, _, phoff, _, _, _, phentsize, phnum, _, _, _ = header.unpack_from(ident, 16)
    phdr = struct.Struct(e + ("IIQQQQQQ" if wide else "IIIIIIII"))
    table = read(phoff, phnum * phentsize)
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None  # (offset, filesz)
    for i in range(phnum):
        at = i * phentsize
        if at + phdr.size > len(table):
            raise ElfError("truncated program headers")
        if wide:
            p_type, _, offset, vaddr, _, filesz, _, _ = phdr.unpack_from(table, at)
        else:
            p_type, offset, vaddr, _, filesz, _, _, _ = phdr.unpack_from(table, at)
        if p_type == PT_LOAD:
            loads.append((vaddr, offset, filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (offset, filesz)
    bits = 64 if wide else 32
    if dynamic is None:
        return ElfInfo(bits, None)
    dyn = struct.Struct(e + ("qQ" if wide else "iI"))
    entries = read(*dynamic)
    strtab = soname = None
    for at in range(0, len(entries) - dyn.size + 1, dyn.size):
        tag, value = dyn.unpack_from(entries, at)
        if tag == DT_NULL:
            break
        if tag == DT_STRTAB:
            strtab = value
        elif tag == DT_SONAME:
            soname = value
    if soname is None:
        return ElfInfo(bits, None)
    if strtab is None:
        raise ElfError("DT_SONAME without DT_STRTAB")
    file_offset = next((off + strtab - va for va, off, sz in loads if va <= strtab < va + sz), None)
    if file_offset is None:
        raise ElfError("DT_STRTAB is in no PT_LOAD segment")
    text = read(file_offset + soname, 4096)
    end = text.find(b"\0")
    if end < 0:
        raise ElfError("SONAME string is not NUL-terminated")
    return ElfInfo(bits, text[:end].decode("utf-8", "surrogateescape"))
