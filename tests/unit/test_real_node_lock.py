"""The real-node lock: one real node per machine (the kubelet's device-plugin socket path is fixed), re-entrant
within a process so a test module may hold it around a RealNode that takes it again."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.node import node


def _held_elsewhere(path: Path) -> bool:
    """Whether another process finds the lock file taken (a non-blocking try)."""
    probe = (
        f"import fcntl,sys; f=open({str(path)!r},'w')\n"
        "try: fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError: sys.exit(1)"
    )
    return subprocess.run([sys.executable, "-c", probe], check=False).returncode == 1


def test_the_lock_nests_in_one_process_and_is_held_until_the_outermost_release(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node.cp_build, "cache_root", lambda: tmp_path / "cache")
    path = tmp_path / "real-node.lock"
    with node.real_node_lock():
        node.acquire_node_lock()  # as RealNode.start() does inside the module's hold: no self-deadlock
        assert _held_elsewhere(path)
        node.release_node_lock()  # RealNode.stop()
        assert _held_elsewhere(path)
    assert not _held_elsewhere(path)
