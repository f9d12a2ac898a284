"""The arbiter's CPU per admitted pod (issue 37): what it spends is told by thread, and the commit path does not
redo work per call (a node's gRPC client per call, a deep copy of every object it writes)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from agent.arbiter import controller
from agent.arbiter.commit import json_copy, narrowed
from agent.arbiter.controller import NodeDirectory
from agent.commands.arbiter import thread_cpu_seconds


def test_thread_cpu_is_told_by_kind_with_a_pools_workers_summed() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    workers = [threading.Thread(target=spin, name=f"commit_{i}") for i in range(2)]
    for t in workers:
        t.start()
    try:  # read while they run: an ended thread is no longer in /proc
        deadline = time.monotonic() + 20
        seen = thread_cpu_seconds()
        while seen.get("commit", 0.0) < 0.2 and time.monotonic() < deadline:
            time.sleep(0.05)
            seen = thread_cpu_seconds()
    finally:
        stop.set()
        for t in workers:
            t.join()
    assert seen.get("commit", 0.0) >= 0.2, seen
    assert not any(name.startswith("commit_") for name in seen)  # one line per kind, not per worker
    assert "MainThread" in seen


class _Channel:
    closed = 0

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return lambda *a, **k: None

    def close(self) -> None:
        _Channel.closed += 1


def test_a_nodes_client_is_made_once_per_channel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tried: a GrpcNodeClient (its stub's four method objects) was made for every Reserve and Confirm."""
    made: list[tuple[str, str, str]] = []

    def pinned(address: str, fingerprint: str, node: str, timeout: float) -> Any:
        made.append((node, address, fingerprint))
        return _Channel()

    monkeypatch.setattr(controller, "pinned_channel", pinned)
    directory = NodeDirectory("token")
    first = directory.client("n1", "10.0.0.1:9", "aa")
    assert directory.client("n1", "10.0.0.1:9", "aa") is first
    assert made == [("n1", "10.0.0.1:9", "aa")]
    # a restarted agent (a new certificate): a new channel and client, the old channel closed
    again = directory.client("n1", "10.0.0.1:9", "bb")
    assert again is not first and _Channel.closed == 1
    assert directory.client("n1", "10.0.0.1:9", "bb") is again
    directory.close()


def test_objects_are_copied_before_they_are_edited_for_a_write() -> None:
    pod: dict[str, Any] = {
        "metadata": {"name": "p", "namespace": "ns", "annotations": {"a": "1"}},
        "spec": {
            "schedulingGates": [{"name": "scheduling.gpu-dra-agent.io/arbiter"}],
            "containers": [{"name": "c", "resources": {"limits": {"cpu": 1.5}}}],
        },
    }
    copied = json_copy(pod)
    assert copied == pod and copied is not pod and copied["spec"]["containers"][0] is not pod["spec"]["containers"][0]
    ungated = narrowed(pod, "node-1", 1.7e9)
    assert pod["spec"]["schedulingGates"] and "affinity" not in pod["spec"]  # the informer's copy untouched
    assert "schedulingGates" not in ungated["spec"] and pod["metadata"]["annotations"] == {"a": "1"}


def test_cycles_started_by_the_period_alone_are_counted() -> None:
    """The run loop counts the cycles no change started: those the clock alone made due (a cycle that has not
    said when it is due next, as this stand-in, is due at the next look)."""
    from agent.arbiter.controller import Arbiter, ArbiterConfig

    arbiter = Arbiter(rest=None, token="t", config=ArbiterConfig(period_s=0.01, cycle_gap_s=0.0))  # type: ignore[arg-type]
    stop = threading.Event()
    ran: list[int] = []

    def cycle(*, pipelined: bool = False) -> None:
        ran.append(1)
        if len(ran) == 3:
            arbiter._changed.set()  # an informer's change: the next cycle is not counted
        if len(ran) == 6:
            stop.set()

    arbiter.cycle = cycle  # type: ignore[assignment,method-assign]
    arbiter.run(stop)
    assert len(ran) == 6 and arbiter.unchanged_cycles == 5
