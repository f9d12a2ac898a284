"""The cycle after a change, from the last cycle's session (CycleCache), against a cycle built whole (run_cycle)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.arbiter.core.cycle import CycleResult, run_cycle
from agent.arbiter.core.incremental import CycleCache
from agent.arbiter.core.model import MILLI, JobSpec, PodSpec, Snapshot
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_properties import LEAVES, snapshots
from tests.unit.test_arbiter_support import job, node, pod, queue

# what happens between two cycles: a waiting gang arrives (at the end of the list, or among the others), a waiting
# gang leaves, a waiting gang gets one pod more, a placed gang finishes, the clock moves, or the last cycle's
# decisions are carried out
EVENTS = st.sampled_from(["arrive", "arrive among", "leave", "grow", "finish", "tick", "carried out"])
SIZES = st.sampled_from([250, 500, MILLI, MILLI, 2 * MILLI])


def _waiting_gang(name: str, queue: str, milli: int, size: int, priority: int, created: float) -> JobSpec:
    pods = tuple(PodSpec(f"{name}-{k}", milli, 1000, 2**30) for k in range(size))
    return JobSpec(name, queue, priority, priority < 100, max(1, size - 1), created, pods)


def _waiting(snapshot: Snapshot) -> list[int]:
    return [i for i, j in enumerate(snapshot.jobs) if all(p.node is None for p in j.pods)]


def _next(snapshot: Snapshot, event: str, pick: int, size: int, result: CycleResult, step: int) -> Snapshot:
    jobs = list(snapshot.jobs)
    waiting = _waiting(snapshot)
    if event.startswith("arrive"):
        gang = _waiting_gang(
            f"new{step}", LEAVES[pick % len(LEAVES)], size, 1 + pick % 3, (10, 50, 125)[pick % 3], step
        )
        jobs.insert(pick % (len(jobs) + 1) if event == "arrive among" else len(jobs), gang)
    elif event == "leave" and waiting:
        del jobs[waiting[pick % len(waiting)]]
    elif event == "grow" and waiting:
        i = waiting[pick % len(waiting)]
        extra = PodSpec(f"{jobs[i].name}-more{step}", size, 1000, 2**30)
        jobs[i] = dataclasses.replace(jobs[i], pods=(*jobs[i].pods, extra))
    elif event == "finish" and len(waiting) < len(jobs):
        placed = [i for i in range(len(jobs)) if i not in waiting]
        del jobs[placed[pick % len(placed)]]
    elif event == "tick":
        return dataclasses.replace(snapshot, now=1.7e9 + 60 * step)
    elif event == "carried out":
        return result.next
    return dataclasses.replace(snapshot, jobs=tuple(jobs))


def _same(cached: CycleResult, whole: CycleResult) -> None:
    assert cached.pods == whole.pods
    assert list(cached.pods) == list(whole.pods)
    assert cached.evictions == whole.evictions
    assert cached.admissions == whole.admissions
    assert cached.pending_jobs == whole.pending_jobs
    assert cached.fair_share == whole.fair_share
    assert cached.allocated == whole.allocated
    assert cached.protected == whole.protected


@settings(max_examples=300, deadline=None)
@given(
    document=snapshots(),
    steps=st.lists(st.tuples(EVENTS, st.integers(0, 50), SIZES), min_size=1, max_size=8),
)
def test_a_cycle_after_a_change_decides_as_a_cycle_built_whole(
    document: dict[str, Any], steps: list[tuple[str, int, int]]
) -> None:
    """Random clusters (running, releasing and waiting gangs, whole and shared GPUs, every placement policy), then
    random events between cycles. After each, the cycle CycleCache runs from the last cycle's session decides
    exactly what run_cycle decides from the snapshot alone: every pod's decision, evictions, admissions, waiting
    gangs, fair shares, allocations and protections. A change of waiting gangs never builds the session whole."""
    cache = CycleCache()
    snapshot = parse_snapshot(document)
    last = cache.run(snapshot)
    _same(last, run_cycle(snapshot))
    for step, (event, pick, size) in enumerate(steps):
        snapshot = _next(snapshot, event, pick, size, last, step)
        last = cache.run(snapshot)
        _same(last, run_cycle(snapshot))
        if event not in ("finish", "carried out"):  # those build whole where a pod sharing a GPU comes or goes
            assert not cache.rebuilt


def _cluster() -> Snapshot:
    running = job("running", "t1", [pod(f"running-{k}", 1, "n0", "Running") for k in range(4)], priority=10)
    queues = [queue("d", quota=4), queue("t1", parent="d", quota=2), queue("t2", parent="d", quota=2)]
    return parse_snapshot({"nodes": [node("n0", 4)], "queues": queues, "jobs": [running]})


def test_a_gang_that_arrives_is_decided_without_building_the_session_again() -> None:
    """A full node whose gang runs beyond its queue's quota; a gang of another queue arrives: the next cycle, from
    the last one's session, evicts for it as a cycle built whole does."""
    cache = CycleCache()
    snapshot = _cluster()
    first = cache.run(snapshot)
    assert cache.rebuilt and not first.evictions
    arrived = dataclasses.replace(snapshot, jobs=(*snapshot.jobs, _waiting_gang("new", "t2", MILLI, 2, 50, 1.0)))
    result = cache.run(arrived)
    assert not cache.rebuilt
    assert [e.pod for e in result.evictions] == [e.pod for e in run_cycle(arrived).evictions]
    assert result.evictions and result.pods["new-0"].action == "pipeline"


def test_a_gang_that_finished_frees_its_gpus_without_building_the_session_again() -> None:
    """The running gang leaves (its pods finished): the next cycle from the last one's session binds the waiting
    gang on the GPUs it freed, as a cycle built whole does."""
    cache = CycleCache()
    waiting = _waiting_gang("new", "t1", MILLI, 2, 10, 1.0)
    snapshot = dataclasses.replace(_cluster(), jobs=(*_cluster().jobs, waiting))
    assert cache.run(snapshot).pods["new-0"].action == "keep"
    finished = dataclasses.replace(snapshot, jobs=(waiting,))
    result = cache.run(finished)
    assert not cache.rebuilt
    assert result.pods == run_cycle(finished).pods
    assert [result.pods[f"new-{k}"].action for k in range(2)] == ["bind", "bind"]


def test_decisions_carried_out_are_loaded_without_building_the_session_again() -> None:
    """A cycle evicts for a gang and pipelines it; then the victims are gone and the gang's pods wait again (the
    snapshot the simulator's next round starts from): the cycle after, from the last one's session, binds it where
    a cycle built whole does."""
    cache = CycleCache()
    snapshot = dataclasses.replace(_cluster(), jobs=(*_cluster().jobs, _waiting_gang("new", "t2", MILLI, 2, 50, 1.0)))
    first = cache.run(snapshot)
    assert first.evictions
    carried = first.next
    result = cache.run(carried)
    assert not cache.rebuilt
    assert result.pods == run_cycle(carried).pods
    assert result.pods["new-0"].action == "bind"


def test_a_pod_sharing_a_gpu_that_comes_builds_the_session_again() -> None:
    """The first placed pod sharing a GPU changes the order every placed pod is seated in: the session is built
    whole, and decides as run_cycle does."""
    cache = CycleCache()
    snapshot = _cluster()
    cache.run(snapshot)
    shared = JobSpec("shared", "t2", 50, True, 1, 1.0, (PodSpec("shared-0", 500, 1000, 2**30, "Running", "n0", 0),))
    running = snapshot.jobs[0]
    freed = dataclasses.replace(running, pods=running.pods[1:], min_member=3)
    changed = dataclasses.replace(snapshot, jobs=(freed, shared))
    result = cache.run(changed)
    assert cache.rebuilt
    assert result.pods == run_cycle(changed).pods
