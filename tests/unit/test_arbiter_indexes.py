"""The indexes and shortcuts that keep a cycle fast at scale decide exactly as a plain re-computation would."""

from __future__ import annotations

import gc
from typing import Any

import pytest
from hypothesis import given, settings

from agent.arbiter.core.cluster import NodeSet
from agent.arbiter.core.cycle import gc_paused
from agent.arbiter.core.model import Vector
from agent.arbiter.core.placing import place_chunk
from agent.arbiter.core.session import Job, JobOrder, Queue, QueueRank, Session, request_of
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_properties import snapshots
from tests.unit.test_arbiter_support import cycle, doc, gang, job, node, pod, queue


def test_node_set_walks_its_members_in_index_order_whatever_order_they_came_in() -> None:
    nodes = NodeSet()
    for i in reversed(range(100)):
        nodes.add(i)
    for i in range(0, 100, 3):
        nodes.discard(i)
    nodes.add(1)  # already a member: nothing changes
    nodes.add(0)  # back in: still first, as index order (= node-name order) says
    nodes.discard(1000)  # not a member: nothing happens
    assert list(nodes) == [0] + [i for i in range(100) if i % 3]
    assert len(nodes) == 67 and 0 in nodes and 3 not in nodes
    for i in list(nodes):
        nodes.discard(i)
    assert not nodes and list(nodes) == []


class _ReRanked:
    """The job order computed from scratch at every pop: the definition JobOrder's caches must agree with."""

    def __init__(self, session: Session, jobs: list[Job]) -> None:
        self.session = session
        self.waiting: dict[Queue, list[tuple[tuple[int, int, float, int], int, Job, Vector]]] = {}
        for j in jobs:
            self.push(j)

    def push(self, j: Job) -> None:
        req = request_of(j.chunk() or j.pending()[:1])
        self.waiting.setdefault(j.queue, []).append((j.key(), j.index, j, req))

    def pop(self) -> Job | None:
        found = self._best(None)
        if found is None:
            return None
        entries = self.waiting[found.queue]
        entries.remove(min(entries))
        return found

    def _best(self, q: Queue | None) -> Job | None:
        kids = q.children if q is not None else self.session.tops
        if q is not None and not kids:
            entries = self.waiting.get(q)
            return min(entries)[2] if entries else None
        best: tuple[Any, Job] | None = None
        for child in kids:
            candidate = self._best(child)
            if candidate is not None:
                entry = min(self.waiting[candidate.queue])
                key = QueueRank(child, entry[3])
                if best is None or key.before(best[0]):
                    best = (key, candidate)
        return best[1] if best else None


def _allocate_with(session: Session, order: JobOrder | _ReRanked) -> list[str]:
    """Allocate's loop, recording which job each pop gave."""
    popped = []
    while (j := order.pop()) is not None:
        popped.append(j.spec.name)
        chunk = j.chunk()
        placed = chunk is not None and session.admissible(j, j.chunk_request()) and place_chunk(session, j, chunk)
        if placed and j.chunk() is not None:
            order.push(j)
    return popped


@settings(max_examples=100, deadline=None)
@given(document=snapshots())
def test_job_order_pops_what_a_full_re_ranking_would(document: dict[str, Any]) -> None:
    cached, plain = Session(parse_snapshot(document)), Session(parse_snapshot(document))
    got = _allocate_with(cached, JobOrder(cached, [j for j in cached.jobs if j.chunk() is not None]))
    want = _allocate_with(plain, _ReRanked(plain, [j for j in plain.jobs if j.chunk() is not None]))
    assert got == want


def test_a_jobs_next_chunk_follows_binds_and_rollbacks() -> None:
    session = Session(parse_snapshot(doc([node("n", 4)], [queue("q")], [gang("g", "q", 3, min_member=2)])))
    j = session.jobs[0]
    first = j.chunk()
    assert first is not None and [p.spec.name for p in first] == ["g-0", "g-1"]
    assert j.chunk_request()[0] == 2000
    mark = session.checkpoint()
    assert place_chunk(session, j, first)
    grown = j.chunk()
    assert grown is not None and [p.spec.name for p in grown] == ["g-2"]  # at minMember: one pod of growth
    session.rollback(mark)
    again = j.chunk()
    assert again is not None and [p.spec.name for p in again] == ["g-0", "g-1"]
    assert [p.spec.name for p in j.pending()] == ["g-0", "g-1", "g-2"]


def test_reclaim_judges_a_victim_queue_before_each_pick_and_re_ranks_after_it() -> None:
    # b (lower priority, so first in reverse queue order) runs 2 GPUs on an allocatable share of 1.5: judged
    # before the pick it is above, so one of its pods goes (KAI reclaimable.go judges the victim queue's
    # allocation before the victim leaves) and leaves it at 1. Re-ranked, b is now at or under its quota and
    # no victim any more; the second GPU comes from c (5 on 2), its newest job.
    queues = [
        queue("a", quota=4, weight=0),
        queue("b", quota=1.5, weight=0, priority=50),
        queue("c", quota=2, weight=0),
    ]
    jobs = [
        *(gang(f"b{i}", "b", 1, node="n", created=f"2025-01-01T00:0{i}:00Z") for i in range(2)),
        *(gang(f"c{i}", "c", 1, node="n", created=f"2025-01-01T00:0{i}:00Z") for i in range(5)),
        gang("want", "a", 2, created="2025-01-02T00:00:00Z"),
    ]
    result = cycle(doc([node("n", 7)], queues, jobs), "reclaim")
    assert result.fair_share["b"][0] == 1500 and result.fair_share["c"][0] == 2000
    assert [n for n, d in result.pods.items() if d.action == "pipeline"] == ["want-0", "want-1"]
    assert sorted(n for n, d in result.pods.items() if d.outcome == "evicted") == ["b1-0", "c4-0"]
    assert result.allocated["b"][0] == 1000


def test_every_evicted_pod_names_its_cause_even_after_a_partial_restore() -> None:
    # the 2-pod victim gang is evicted whole; the pending pod takes one of its GPUs, so putting the gang back
    # fails half way and both its pods stay evicted, both by preempt
    jobs = [
        job("low", "q", [pod("low-0", 1, "n"), pod("low-1", 1, "n")], priority=10),
        gang("high", "q", 1, priority=60),
    ]
    result = cycle(doc([node("n", 2)], [queue("q")], jobs), "preempt")
    assert result.pods["high-0"].action == "pipeline"
    assert {n: (d.outcome, d.cause) for n, d in result.pods.items() if n.startswith("low")} == {
        "low-0": ("evicted", "preempt"),
        "low-1": ("evicted", "preempt"),
    }
    assert sorted(e.pod for e in result.evictions) == ["low-0", "low-1"]


def test_next_round_keeps_untouched_pods_and_moves_the_rest() -> None:
    jobs = [gang("run", "q", 2, node="n"), gang("new", "q", 2), gang("late", "q", 8)]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "allocate")
    pods = {p.name: p for j in result.next.jobs for p in j.pods}
    assert {n: (pods[n].status, pods[n].node) for n in ("run-0", "new-0", "late-0")} == {
        "run-0": ("Running", "n"),
        "new-0": ("Running", "n"),
        "late-0": ("Pending", None),
    }


@pytest.mark.parametrize("enabled", [True, False])
def test_a_cycle_leaves_the_garbage_collector_as_it_found_it(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        with pytest.raises(RuntimeError), gc_paused():
            assert not gc.isenabled()
            raise RuntimeError("a failing cycle")  # tried: the collector comes back even then
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
