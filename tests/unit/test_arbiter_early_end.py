"""Reclaim and preempt end once no leaf queue has a waiting job that could still evict (evict._Able), instead of
popping every waiting job to the end: the same decisions, fewer pops.

The evict module is loaded from its source for these tests, so its pieces can be swapped where the arbiter core is
compiled (its classes then take no attributes from Python): the queue order counted, the early end switched off.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

from hypothesis import given, settings

from agent.arbiter.core.allocate import allocate
from agent.arbiter.core.session import Job, JobOrder, Queue, Session
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_properties import snapshots
from tests.unit.test_arbiter_support import job, node, pod, queue

SOURCE = Path(__file__).resolve().parents[2] / "agent" / "arbiter" / "core" / "evict.py"


def _evict_from_source(*, early_end: bool) -> tuple[ModuleType, list[int]]:
    """The evict module as source, with its queue order counting pops (into the list returned, one entry per
    action run); without `early_end` its leaves never run out while a heap holds a job, as before the early end."""
    spec = importlib.util.spec_from_file_location(f"evict_source_{early_end}", SOURCE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pops: list[int] = []

    class CountedOrder:
        def __init__(self, session: Session, jobs: Any) -> None:
            self._order = JobOrder(session, jobs)
            pops.append(0)

        def pop(self) -> Job | None:
            pops[-1] += 1
            return self._order.pop()

        def push(self, job: Job) -> None:
            self._order.push(job)

    class Endless(module._Able):  # type: ignore[name-defined,misc]
        def _able(self, q: Queue) -> bool:
            return bool(q.heap)

    module.JobOrder = CountedOrder
    if not early_end:
        module._Able = Endless
    return module, pops


def _decide(document: dict[str, Any], *, early_end: bool) -> tuple[list[tuple[object, ...]], list[int]]:
    """Allocate, then reclaim and preempt from the source module: every pod's state, seat and cause after."""
    evict, pops = _evict_from_source(early_end=early_end)
    session = Session(parse_snapshot(document))
    allocate(session)
    evict.reclaim(session)
    evict.preempt(session)
    seats = [
        (p.spec.name, p.state, p.cause, None if p.seat is None else (p.seat.node, tuple(p.seat.gpus)))
        for p in session.pods
    ]
    return seats, pops


@settings(max_examples=300, deadline=None)
@given(document=snapshots())
def test_ending_early_decides_as_popping_every_waiting_job(document: dict[str, Any]) -> None:
    """Random clusters (running, releasing and waiting gangs, whole and shared GPUs, queues in two levels with
    quotas and priorities): reclaim and preempt that end once no leaf can act leave every pod as the same actions
    do when they pop every waiting job, and never pop more."""
    ended, ended_pops = _decide(document, early_end=True)
    endless, endless_pops = _decide(document, early_end=False)
    assert ended == endless
    assert all(a <= b for a, b in zip(ended_pops, endless_pops, strict=True))


def test_preempt_stops_once_no_waiting_job_outranks_a_victim() -> None:
    """One node, held by a priority-10 gang; a priority-50 gang waits for it, and after it 20 gangs of priority 5,
    which nothing in their queue ranks below. Preempt evicts for the first and ends there: it does not pop the 20
    whose turn could take no one."""
    jobs = [
        job("low", "t", [pod(f"low-{k}", 1, "n0") for k in range(2)], priority=10),
        job("urgent", "t", [pod(f"urgent-{k}", 1) for k in range(2)], priority=50),
        *(job(f"idle{i}", "t", [pod(f"idle{i}-0", 1)], priority=5) for i in range(20)),
    ]
    document = {"nodes": [node("n0", 2)], "queues": [queue("d"), queue("t", parent="d")], "jobs": jobs}
    ended, ended_pops = _decide(document, early_end=True)
    endless, endless_pops = _decide(document, early_end=False)
    assert ended == endless
    states = {name: (state, cause) for name, state, cause, _ in ended}
    assert states["low-0"] == ("evicted", "preempt") and states["urgent-0"][0] == "pipelined"
    preempt_pops, endless_preempt_pops = ended_pops[-1], endless_pops[-1]
    assert preempt_pops == 1  # the urgent gang, then no leaf is able
    assert endless_preempt_pops == 21  # the urgent gang and the 20 idle ones
