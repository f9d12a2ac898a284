"""Crash-safe file replacement: after a crash at any point a reader sees the old content or the new, never
a mix, and a rename that returned survives a power loss."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def write_atomic(path: Path, data: bytes, *, durable: bool = True) -> None:
    """Write `data` to a temp file beside `path`, fsync it, rename it over `path`, fsync the directory.

    With `durable=False` both fsyncs are skipped: the rename still makes the write atomic for readers and
    across a crash of this process, which is all a file that can be rebuilt after a power loss needs.

    The temp name ends in `.tmp`, so a CDI runtime (which loads only *.yaml / *.json) never reads a half
    file; on failure the temp file is removed, and one left by a crash is found by `leftover_temps`.
    """
    fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic_many(contents: Mapping[Path, bytes], *, durable: bool = True) -> None:
    """`write_atomic` for several files at once: each is replaced atomically and durably, with one fsync per
    file and one per directory (not two per file). A failure leaves each file old or new, never a mix.
    `durable=False` skips the fsyncs, as `write_atomic` does."""
    temps: dict[Path, str] = {}
    try:
        for path, data in contents.items():
            fd, temps[path] = tempfile.mkstemp(prefix=f"{path.name}.", suffix=TEMP_SUFFIX, dir=path.parent)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if durable:
                    os.fsync(f.fileno())
        for path in list(temps):
            os.replace(temps[path], path)
            del temps[path]  # only once renamed: a failed rename's temp is removed below
    finally:
        for tmp in temps.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    for directory in {path.parent for path in contents} if durable else ():
        fsync_dir(directory)


def remove(path: Path) -> bool:
    """Remove `path`; False when it was not there. Not made durable: after a power loss the reboot voids
    every claim, and startup recovery removes whatever files came back."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def leftover_temps(directory: Path, name_prefix: str) -> list[Path]:
    """Temp files `write_atomic` left behind for files whose names start with `name_prefix`."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.name.startswith(name_prefix) and p.name.endswith(TEMP_SUFFIX))
