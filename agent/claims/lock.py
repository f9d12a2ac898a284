"""The node-wide prepare/unprepare lock: an flock on `<state-dir>/pu.lock`, so two agent instances (a
rolling update runs both) never interleave their checkpoint updates."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from agent.claims.checkpoint import CheckpointCorrupt

LOCK_FILE = "pu.lock"


class LockTimeout(TimeoutError):
    """Another prepare or unprepare held the lock for longer than the timeout."""


class LockUnusable(CheckpointCorrupt):
    """Something other than a lock file is in its place: without the lock the checkpoint cannot be trusted."""


class NodeLock:
    def __init__(self, path: Path, timeout: float = 10.0, poll: float = 0.002) -> None:
        self.path = Path(path)
        self.timeout = timeout
        self.poll = poll
        self._local = threading.Lock()  # threads of this process queue here instead of polling the flock

    @contextmanager
    def hold(self, timeout: float | None = None) -> Iterator[None]:
        """Hold the lock; wait at most `timeout` seconds for it (never longer than the lock's own)."""
        wait = self.timeout if timeout is None else min(timeout, self.timeout)
        deadline = time.monotonic() + wait
        if not self._local.acquire(timeout=wait):
            raise LockTimeout(f"{self.path}: held by another thread for {wait:g}s")
        try:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            except IsADirectoryError:
                raise LockUnusable(f"{self.path} is a directory where the node lock file belongs; remove it") from None
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockTimeout(f"{self.path}: held by another process for {wait:g}s") from None
                        time.sleep(self.poll)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        finally:
            self._local.release()
