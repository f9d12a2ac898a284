"""When the clock alone changes a cycle's decisions (core.due): the arbiter sleeps until then when nothing changed,
so a moment it misses is a decision made late, and a cycle it skips must be one that would have repeated."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.arbiter.core.cycle import DEFAULT_ACTIONS, CycleResult, run_cycle
from agent.arbiter.core.due import next_due
from agent.arbiter.core.evict import SAME_BURST_S
from agent.arbiter.core.model import Snapshot
from agent.arbiter.core.snapshot import parse_snapshot
from agent.times import parse_rfc3339
from tests.unit.test_arbiter_cycle_cache import _same
from tests.unit.test_arbiter_properties import snapshots
from tests.unit.test_arbiter_support import doc, gang, node, queue

NOW = "2025-01-01T12:00:00Z"


def _at(snapshot: Snapshot, moment: float) -> Snapshot:
    return dataclasses.replace(snapshot, now=moment)


def _evicted(snapshot: Snapshot) -> list[str]:
    result = run_cycle(snapshot, list(DEFAULT_ACTIONS))
    return sorted(n for n, d in result.pods.items() if d.outcome == "evicted")


def _epoch(text: str) -> float:
    moment = parse_rfc3339(text)
    assert moment is not None
    return moment


def test_a_victim_protected_by_its_queues_min_runtime_is_taken_at_the_moment_it_names() -> None:
    # low started 11:30 under a dept whose preemptMinRuntime is 1 h: protected until 12:30, when high, waiting
    # beside it, may preempt it; its same-burst window (30 s after its start) is long past
    queues = [queue("dept", preemptMinRuntime="1h"), queue("team", parent="dept")]
    low = gang("low", "team", 2, node="n", priority=10)
    low["startedAt"] = "2025-01-01T11:30:00Z"
    document = doc([node("n", 2)], queues, [low, gang("high", "team", 2, priority=60, created=NOW)])
    document["now"] = NOW
    snapshot = parse_snapshot(document)
    due = next_due(snapshot)
    assert due == _epoch("2025-01-01T12:30:00Z")
    assert _evicted(snapshot) == [] and _evicted(_at(snapshot, due - 0.001)) == []
    assert _evicted(_at(snapshot, due)) == ["low-0", "low-1"]
    assert next_due(_at(snapshot, due)) == math.inf  # nothing ahead any more


def test_a_waiting_jobs_preemption_delay_ends_at_the_moment_it_names() -> None:
    high = gang("high", "q", 2, priority=60)
    high["preemptionDelay"] = "5m"
    high["pendingSince"] = "2025-01-01T11:58:00Z"
    document = doc([node("n", 2)], [queue("q")], [gang("low", "q", 2, node="n", priority=10), high])
    document["now"] = NOW
    snapshot = parse_snapshot(document)
    due = next_due(snapshot)
    assert due == _epoch("2025-01-01T12:03:00Z")
    assert _evicted(_at(snapshot, due - 0.001)) == [] and _evicted(_at(snapshot, due)) == ["low-0", "low-1"]


def test_the_earliest_moment_ahead_counts_and_those_past_do_not() -> None:
    low = gang("low", "q", 1, node="n", priority=10)
    low["startedAt"] = "2025-01-01T11:59:50Z"  # its same-burst window ends 30 s later, before the min-runtime
    document = doc([node("n", 2)], [queue("q", reclaimMinRuntime="10m")], [low])
    document["now"] = NOW
    snapshot = parse_snapshot(document)
    started = _epoch("2025-01-01T11:59:50Z")
    assert next_due(snapshot) == started + SAME_BURST_S
    assert next_due(_at(snapshot, started + SAME_BURST_S)) == started + 600
    assert next_due(_at(snapshot, started + 600)) == math.inf


def test_a_snapshot_without_a_clock_has_nothing_due() -> None:
    low = gang("low", "q", 1, node="n")
    low["startedAt"] = NOW
    assert next_due(parse_snapshot(doc([node("n", 1)], [queue("q", preemptMinRuntime="1h")], [low]))) == math.inf


@settings(max_examples=200, deadline=None)
@given(
    document=snapshots(),
    started=st.lists(st.one_of(st.none(), st.floats(-4000, 0)), min_size=8, max_size=8),
    delays=st.lists(st.sampled_from([0.0, 0.0, 60.0, 900.0]), min_size=8, max_size=8),
    runtimes=st.lists(st.sampled_from([None, 0.0, 120.0, 1800.0, 3600.0]), min_size=2, max_size=2),
    where=st.floats(0, 1, exclude_max=True),
)
def test_between_now_and_the_next_due_moment_a_cycle_decides_the_same(
    document: dict[str, Any],
    started: list[float | None],
    delays: list[float],
    runtimes: list[float | None],
    where: float,
) -> None:
    """Random clusters whose jobs started at random moments of the last hour and whose waiting jobs have random
    preemption delays, under queues with random min-runtimes: a cycle at any moment before `next_due` decides
    exactly what the cycle at `now` decides, so the arbiter may skip every look in between."""
    now = 1.7e9
    snapshot = parse_snapshot(document)
    jobs = tuple(
        dataclasses.replace(
            j,
            started_at=None if started[i] is None else now + started[i],
            preemption_delay=delays[i],
            pending_since=now - 300.0,
            weighed_since=now - 300.0,  # a victim started since then is in its burst for SAME_BURST_S
        )
        for i, j in enumerate(snapshot.jobs)
    )
    queues = tuple(
        dataclasses.replace(q, preempt_min_runtime=runtimes[0], reclaim_min_runtime=runtimes[1])
        for q in snapshot.queues
    )
    snapshot = dataclasses.replace(snapshot, jobs=jobs, queues=queues, now=now)
    due = next_due(snapshot)
    assert due > now
    end = min(due, now + 7200.0)
    decided: CycleResult = run_cycle(snapshot, list(DEFAULT_ACTIONS))
    for later in (now + where * (end - now), end - 0.001):  # anywhere before it, and the last moment
        _same(run_cycle(_at(snapshot, later), list(DEFAULT_ACTIONS)), decided)
