"""glibc's /etc/ld.so.cache, read without asking any ldconfig (the agent's image is not the driver's root).

Three layouts exist (glibc elf/cache.c, sysdeps/generic/dl-cache.h): the old `ld.so-1.7.0` table alone
(glibc < 2.2), the old table followed by the new `glibc-ld.so.cache1.1` one (the compat layout glibc wrote
until 2.32), and the new table alone (glibc >= 2.32's default). Strings in the new table are offsets from the
new header; in the old one, from the end of its entry table. Little-endian only: the driver roots this
agent serves (x86-64, aarch64, ppc64le) all are.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

OLD_MAGIC = b"ld.so-1.7.0"
NEW_MAGIC = b"glibc-ld.so.cache1.1"

_OLD_HEADER = struct.Struct("<12sI")  # magic (NUL-terminated), nlibs
_OLD_ENTRY = struct.Struct("<iII")  # flags, key, value
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")  # magic+version, nlibs, len_strings, flags, extension_offset
_NEW_ENTRY = struct.Struct("<iIIIQ")  # flags, key, value, osversion (unused), hwcap

FLAG_TYPE_MASK = 0x00FF
FLAG_ELF = 0x0001  # FLAG_ELF_LIBC6 (3) includes it
FLAG_ARCH_MASK = 0xFF00
ARCH_64 = {0x0300: "x86-64", 0x0A00: "aarch64", 0x0500: "ppc64le"}


class LdCacheError(ValueError):
    """The bytes are not an ld.so.cache this reader knows."""


@dataclass(frozen=True)
class CacheEntry:
    name: str  # the soname, e.g. libcuda.so.1
    path: str  # where the loader finds it, absolute within the root the cache belongs to
    flags: int

    @property
    def is_64bit_elf(self) -> bool:
        return bool(self.flags & FLAG_TYPE_MASK & FLAG_ELF) and (self.flags & FLAG_ARCH_MASK) in ARCH_64


def _string(data: bytes, offset: int) -> str:
    if not 0 <= offset < len(data):
        raise LdCacheError(f"string offset {offset} outside the {len(data)}-byte cache")
    end = data.find(b"\0", offset)
    if end < 0:
        raise LdCacheError(f"string at {offset} is not NUL-terminated")
    return data[offset:end].decode("utf-8", "surrogateescape")


def parse(data: bytes) -> list[CacheEntry]:
    """Every entry of the cache, in its order (the loader's preference order)."""
    if data.startswith(NEW_MAGIC):
        return _parse_new(data, 0)
    if not data.startswith(OLD_MAGIC):
        raise LdCacheError("not an ld.so.cache (neither the ld.so-1.7.0 nor the glibc-ld.so.cache1.1 magic)")
    if len(data) < _OLD_HEADER.size:
        raise LdCacheError("truncated ld.so-1.7.0 header")
    _, nlibs = _OLD_HEADER.unpack_from(data, 0)
    table_end = _OLD_HEADER.size + nlibs * _OLD_ENTRY.size
    if table_end > len(data):
        raise LdCacheError(f"ld.so-1.7.0 table of {nlibs} entries runs past the end")
    new_at = table_end + (-table_end % 8)  # the compat layout aligns the new header to 8 bytes
    if data[new_at : new_at + len(NEW_MAGIC)] == NEW_MAGIC:
        return _parse_new(data, new_at)
    entries = []
    for i in range(nlibs):
        flags, key, value = _OLD_ENTRY.unpack_from(data, _OLD_HEADER.size + i * _OLD_ENTRY.size)
        entries.append(CacheEntry(_string(data, table_end + key), _string(data, table_end + value), flags))
    return entries


def _parse_new(data: bytes, start: int) -> list[CacheEntry]:
    if len(data) < start + _NEW_HEADER.size:
        raise LdCacheError("truncated glibc-ld.so.cache1.1 header")
    _, nlibs, _, _, _ = _NEW_HEADER.unpack_from(data, start)
    first = start + _NEW_HEADER.size
    if first + nlibs * _NEW_ENTRY.size > len(data):
        raise LdCacheError(f"glibc-ld.so.cache1.1 table of {nlibs} entries runs past the end")
    strings = data[start:]
    entries = []
    for i in range(nlibs):
        flags, key, value, _, _ = _NEW_ENTRY.unpack_from(data, first + i * _NEW_ENTRY.size)
        entries.append(CacheEntry(_string(strings, key), _string(strings, value), flags))
    return entries
