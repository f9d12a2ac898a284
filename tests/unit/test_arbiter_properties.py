"""Invariants of a full cycle on random clusters: capacity, gangs, limits, reclaim and restored victims."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.arbiter.core.cycle import ACTIONS, DEFAULT_ACTIONS
from agent.arbiter.core.model import MILLI
from agent.arbiter.core.session import Queue, Session, request_of
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_support import job, node, pod, queue

QUEUES = [queue("d1", quota=4, weight=1), queue("d2", quota=2, weight=2, limit=10),
          queue("t1", parent="d1", quota=2), queue("t2", parent="d1", quota=0, priority=150),
          queue("t3", parent="d2", quota=-1, weight=0)]
LEAVES = ["t1", "t2", "t3"]


@st.composite
def snapshots(draw: st.DrawFn) -> dict[str, Any]:
    nodes = [node(f"n{i}", draw(st.sampled_from([1, 2, 4, 8])), cpu=draw(st.sampled_from([4000, 16000])))
             for i in range(draw(st.integers(1, 4)))]
    free = {n["name"]: [0.0] * n["gpus"] for n in nodes}  # GPU use per device, to draw a valid running state
    cpu = {n["name"]: n["cpuMilli"] for n in nodes}
    jobs = []
    for j in range(draw(st.integers(1, 8))):
        size = draw(st.integers(1, 4))
        gpus = draw(st.sampled_from([0.25, 0.5, 1, 1, 2]))
        running = draw(st.booleans())
        pods = []
        for k in range(size):
            where, index, status = None, None, "Pending"
            if running:
                for name, devices in free.items():
                    fits = [g for g, used in enumerate(devices)
                            if used + min(gpus, 1) <= 1 and (gpus < 1 or used == 0)]
                    if cpu[name] >= 1000 and len(fits) >= max(1, int(gpus)):
                        take = fits[: max(1, int(gpus))]
                        for g in take:
                            devices[g] += gpus if gpus < 1 else 1
                        cpu[name] -= 1000
                        where, status = name, draw(st.sampled_from(["Running", "Running", "Releasing"]))
                        index = take[0] if gpus < 1 else None
                        break
            extra = {"gpuIndex": index} if index is not None else {}
            pods.append(pod(f"j{j}-{k}", gpus, where, status, cpu=1000, **extra))
        placed = sum(1 for p in pods if p["status"] == "Running")
        min_member = draw(st.integers(1, size))
        if 0 < placed < min_member:
            min_member = placed
        jobs.append(job(f"j{j}", draw(st.sampled_from(LEAVES)), pods, priority=draw(st.sampled_from([10, 50, 125])),
                        min_member=min_member, created=f"2025-01-01T00:0{j}:00Z"))
    return {"nodes": nodes, "queues": QUEUES, "jobs": jobs,
            "config": {"placement": {"gpu": draw(st.sampled_from(["binpack", "spread"]))}}}


actions = st.lists(st.sampled_from(list(DEFAULT_ACTIONS)), min_size=1, max_size=4)


def run(document: dict[str, Any], names: list[str]) -> Session:
    session = Session(parse_snapshot(document))
    for name in names:
        ACTIONS[name](session)
    return session


@settings(max_examples=150, deadline=None)
@given(document=snapshots(), names=actions)
def test_no_node_is_ever_over_allocated(document: dict[str, Any], names: list[str]) -> None:
    session = run(document, names)
    # what each pod holds now (before pending releases finish) and after them
    now = [(p, p.seat) for p in session.pods if p.state in ("running", "releasing", "evicted", "bound")]
    after = [(p, p.seat) for p in session.pods if p.state in ("running", "bound", "pipelined")]
    after += [(p, p.moved_to) for p in session.pods if p.moved_to is not None]
    for layer in (now, after):
        for n in session.cluster.nodes:
            here = [(p, seat) for p, seat in layer if seat is not None and seat.node == n.index]
            assert sum(p.spec.cpu_milli for p, _ in here) <= n.spec.cpu_milli + 1e-6
            use = [0] * n.spec.gpus
            for p, seat in here:
                for g in seat.gpus:
                    use[g] += p.spec.gpu_milli if p.spec.fractional else MILLI
            assert all(u <= MILLI for u in use), (n.spec.name, use)


@settings(max_examples=150, deadline=None)
@given(document=snapshots(), names=actions)
def test_no_gang_is_ever_partly_placed(document: dict[str, Any], names: list[str]) -> None:
    session = run(document, names)
    for j in session.jobs:
        gained = [p for p in j.pods if p.state in ("bound", "pipelined")]
        holding = sum(1 for p in j.pods if p.state in ("running", "bound", "pipelined") or p.moved_to)
        if gained:
            assert holding >= j.spec.min_member, j.spec.name
        lost = [p for p in j.pods if p.state == "evicted" and p.moved_to is None]
        if lost:
            assert holding == 0 or holding >= j.spec.min_member, j.spec.name


def _meeting(mine: Queue, theirs: Queue) -> Queue:
    """The victim side's queue just below where the two branches meet."""
    ours = set(mine.path)
    below = [q for q in theirs.path if q not in ours]
    return below[-1] if below else theirs


@settings(max_examples=150, deadline=None)
@given(document=snapshots())
def test_a_queue_within_its_quota_is_never_reclaimed(document: dict[str, Any]) -> None:
    # KAI strategies.go: both strategies need the victim side above its quota (MaintainFairShare: above
    # max(quota, fair share); GuaranteeDeservedQuota: above quota) where the branches meet. What it held when
    # judged is at most what it held before the action plus what it gained in it.
    session = Session(parse_snapshot(document))
    before = {q: list(q.alloc) for q in session.queues}
    ACTIONS["reclaim"](session)
    reclaimers = {p.job.queue for p in session.pods if p.state in ("bound", "pipelined")}
    for victim in (p for p in session.pods if p.cause == "reclaim"):
        sides = {_meeting(r, victim.job.queue) for r in reclaimers}
        assert sides, victim.spec.name
        assert any(
            any(before[q][r] + _gained(session, q)[r] > q.quota[r] + 1e-6 for r in range(3)) for q in sides
        ), victim.spec.name


def _gained(session: Session, q: Queue) -> list[float]:
    gained = [0.0, 0.0, 0.0]
    for p in session.pods:
        if p.state in ("bound", "pipelined") and q in p.job.queue.path:
            for r in range(3):
                gained[r] += p.req[r]
    return gained


@settings(max_examples=150, deadline=None)
@given(document=snapshots(), names=actions)
def test_limits_hold_after_every_action(document: dict[str, Any], names: list[str]) -> None:
    session = Session(parse_snapshot(document))
    for name in names:
        before = {q: list(q.alloc) for q in session.queues}
        ACTIONS[name](session)
        for q in session.queues:
            for r in range(3):
                assert q.alloc[r] <= max(before[q][r], q.limit[r]) + 1e-6, (name, q.spec.name)


@settings(max_examples=150, deadline=None)
@given(document=snapshots(), names=st.sampled_from([["reclaim"], ["preempt"], ["allocate", "reclaim", "preempt"]]))
def test_a_victim_that_still_fits_is_restored(document: dict[str, Any], names: list[str]) -> None:
    # victims go back through allocation before the scenario is taken: none is left evicted whose seat is still
    # free, whose gang would stay whole and whose queue would stay within its limits
    session = run(document, names)
    for j in session.jobs:
        lost = [p for p in j.pods if p.state == "evicted" and p.cause in ("reclaim", "preempt")]
        if not lost or j.active + len(lost) < j.spec.min_member:
            continue
        fits = all(p.seat is not None and session.cluster.seat_free(p.spec, p.seat, bind=False) for p in lost)
        room = session.within_limits(j, request_of(lost))
        assert not (fits and room and len({p.seat for p in lost}) == len(lost)), j.spec.name
