"""When the clock alone changes a cycle's decisions (core.due): the arbiter sleeps until then when nothing changed,
so a moment it misses is a decision made late, and a cycle it skips must be one that would have repeated."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
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
from tests.unit.test_arbiter_kai_rules import inherited_protection
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
    snapshot = parse_snapshot(inherited_protection(NOW))
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
            started_at=None if at is None else now + at,
            preemption_delay=delay,
            pending_since=now - 300.0,
            weighed_since=now - 300.0,  # a victim started since then is in its burst for SAME_BURST_S
        )
        for j, at, delay in zip(snapshot.jobs, started, delays, strict=False)
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
    last = end - 0.001  # the last moment before it (a millisecond: at 1.7e9 s a float's step is 0.24 us)
    for later in (min(now + where * (end - now), last), last):  # anywhere before it, and the last moment
        _same(run_cycle(_at(snapshot, later), list(DEFAULT_ACTIONS)), decided)


# -- the controller's own timers (Arbiter._next_due, at the end of each cycle) ------------------------------


def _arbiter(**config: Any) -> Any:
    from agent.arbiter.controller import Arbiter, ArbiterConfig

    arbiter = Arbiter(rest=None, token="t", config=ArbiterConfig(default_queue=None, **config))  # type: ignore[arg-type]
    arbiter._fence_served = False  # an API before 1.37: no fence to settle
    return arbiter


def _due(arbiter: Any, now: float, unbindable: dict[str, Any] | None = None) -> float:
    from types import SimpleNamespace

    from agent.arbiter.core.model import Snapshot

    world = SimpleNamespace(unbindable=unbindable or {})
    due: float = arbiter._next_due(now, Snapshot(nodes=(), queues=(), jobs=(), now=now), world)
    return due


def test_an_idle_arbiter_is_due_only_when_a_timer_of_its_own_runs_out() -> None:
    from agent.arbiter.world import Unbindable

    now = 1.7e9
    assert _due(_arbiter(), now) == math.inf  # nothing ahead: the run loop's resync alone
    # a pod kube-scheduler refused to bind 10 s ago is reported 30 s after the refusal
    refused = {"ns/p": Unbindable("n1", "0/1 nodes are available", now - 10.0)}
    assert _due(_arbiter(unbindable_after_s=30.0), now, refused) == now + 20.0
    # a Queue status held back by its period is written once the period is over
    held = _arbiter(status_period_s=1.0)
    held._status_written, held._status_held = now - 0.25, True
    assert _due(held, now) == now + 0.75
    # time-aware fair share: usage moves with the clock, by under 0.7 % in a hundredth of its half-life
    assert _due(_arbiter(usage_half_life_s=3600.0), now) == now + 36.0
    assert _due(_arbiter(usage_half_life_s=10.0, period_s=1.0), now) == now + 1.0  # never more often than it looks


def test_work_in_motion_or_to_be_tried_again_keeps_the_periods_pace() -> None:
    now = 1.7e9
    expecting = _arbiter()
    expecting._expected.append(("pods", "ns", "p", "7"))  # a write the informers do not show yet
    assert _due(expecting, now) == now
    evicted = _arbiter()
    evicted._terminating["ns/p"] = "uid-1"  # evicted, not yet seen terminating
    assert _due(evicted, now) == now
    failed = _arbiter()
    failed._again = True  # an eviction the API refused (a PodDisruptionBudget): tried again
    assert _due(failed, now) == now
    unfenced = _arbiter()
    unfenced._fence_served = True  # the fence rule is not in force yet: put in place, then settling
    assert _due(unfenced, now) == now
    unfenced._fenced_since = now - 0.5
    assert _due(unfenced, now) == now + 1.5  # fence_settle_s 2


def test_the_run_loop_cycles_on_a_change_or_once_due_and_otherwise_only_looks() -> None:
    clock = [1.7e9]
    arbiter = _arbiter(period_s=0.01, cycle_gap_s=0.0)
    ran: list[str] = []

    def cycle() -> None:  # a quiet cycle: due in 10 s
        ran.append("cycle")
        arbiter._due = clock[0] + 10.0

    with _running(arbiter, clock, cycle):
        _until(lambda: len(ran) == 1)  # the first look: never cycled, so due
        looks = arbiter.skipped_looks
        _until(lambda: arbiter.skipped_looks >= looks + 20)
        assert len(ran) == 1  # twenty looks, nothing changed, nothing due: no cycle
        arbiter._changed.set()  # an informer's change
        _until(lambda: len(ran) == 2)
        clock[0] += 10.0  # the moment named by the last cycle
        _until(lambda: len(ran) == 3)
        assert arbiter.unchanged_cycles == 2  # the first look's and the clock's: no change started them


@contextlib.contextmanager
def _running(arbiter: Any, clock: list[float], cycle: Callable[[], None]) -> Iterator[None]:
    """The arbiter's run loop in a thread, on the wall clock `clock[0]`, with `cycle` standing in for a cycle."""
    stop = threading.Event()
    arbiter._clock = lambda: clock[0]

    def stand_in(*, pipelined: bool = False) -> None:
        cycle()

    arbiter.cycle = stand_in
    loop = threading.Thread(target=arbiter.run, args=(stop,), daemon=True)
    loop.start()
    try:
        yield
    finally:
        stop.set()
        loop.join(timeout=5)


def _until(check: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_wall_clock_set_back_holds_off_cycles_no_longer_than_the_resync() -> None:
    clock = [1.7e9]
    arbiter = _arbiter(period_s=0.01, cycle_gap_s=0.0, resync_s=0.3)
    ran: list[float] = []

    def cycle() -> None:  # due in 10 s; then the wall clock is set back an hour
        ran.append(time.monotonic())
        arbiter._due = clock[0] + 10.0
        clock[0] -= 3600.0

    with _running(arbiter, clock, cycle):
        _until(lambda: len(ran) >= 4)
    gaps = [b - a for a, b in itertools.pairwise(ran)]
    assert all(0.29 <= g < 2.0 for g in gaps), gaps  # the resync, on the monotonic clock, and no sooner
    assert arbiter.skipped_looks > 0
