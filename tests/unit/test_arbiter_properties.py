"""Invariants of a full cycle on random clusters: capacity, gangs, limits, reclaim and restored victims."""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.arbiter.core.cycle import ACTIONS, DEFAULT_ACTIONS
from agent.arbiter.core.model import MILLI
from agent.arbiter.core.session import Pod, Queue, Session, request_of
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_support import job, node, pod, queue

QUEUES = [
    queue("d1", quota=4, weight=1),
    queue("d2", quota=2, weight=2, limit=10),
    queue("t1", parent="d1", quota=2),
    queue("t2", parent="d1", quota=0, priority=150),
    queue("t3", parent="d2", quota=-1, weight=0),
]
LEAVES = ["t1", "t2", "t3"]


@st.composite
def snapshots(draw: st.DrawFn) -> dict[str, Any]:
    nodes = [
        node(f"n{i}", draw(st.sampled_from([1, 2, 4, 8])), cpu=draw(st.sampled_from([4000, 16000])))
        for i in range(draw(st.integers(1, 4)))
    ]
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
                    fits = [g for g, used in enumerate(devices) if used + min(gpus, 1) <= 1 and (gpus < 1 or used == 0)]
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
        jobs.append(
            job(
                f"j{j}",
                draw(st.sampled_from(LEAVES)),
                pods,
                priority=draw(st.sampled_from([10, 50, 125])),
                min_member=min_member,
                created=f"2025-01-01T00:0{j}:00Z",
            )
        )
    return {
        "nodes": nodes,
        "queues": QUEUES,
        "jobs": jobs,
        "config": {"placement": {"gpu": draw(st.sampled_from(["fgd", "binpack", "spread"]))}},
    }


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
        assert any(any(before[q][r] + _gained(session, q)[r] > q.quota[r] + 1e-6 for r in range(3)) for q in sides), (
            victim.spec.name
        )


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


# preempt takes all of j0 for j1; n0's CPUs then have room for one of j0's pods, not for the two its minMember
# needs: j0 rightly stays evicted, though each of its seats alone is free (which the property once flagged)
_CPU_BOUND = {
    "nodes": [node("n0", 4, cpu=4000)],
    "queues": QUEUES,
    "jobs": [
        job("j0", "t1", [pod(f"j0-{i}", 1, "n0") for i in range(3)], priority=10, min_member=2),
        job("j1", "t1", [pod(f"j1-{i}", 0.25) for i in range(2)], priority=50, created="2025-01-01T00:01:00Z"),
        job("j2", "t1", [pod("j2-0", 0.25)], priority=10, created="2025-01-01T00:02:00Z"),
    ],
}


@settings(max_examples=150, deadline=None)
@given(document=snapshots(), names=st.sampled_from([["reclaim"], ["preempt"], ["allocate", "reclaim", "preempt"]]))
@example(document=_CPU_BOUND, names=["allocate", "reclaim", "preempt"])
def test_a_victim_that_still_fits_is_restored(document: dict[str, Any], names: list[str]) -> None:
    # victims go back through allocation before the scenario is taken: none is left evicted whose seats are still
    # free (all of them together), whose gang would stay whole and whose queue would stay within its limits
    session = run(document, names)
    for j in session.jobs:
        lost = [p for p in j.pods if p.state == "evicted" and p.cause in ("reclaim", "preempt")]
        if not lost or j.active + len(lost) < j.spec.min_member:
            continue
        room = session.within_limits(j, request_of(lost))
        assert not (room and _all_fit(session, lost)), j.spec.name


def _all_fit(session: Session, lost: list[Pod]) -> bool:
    """Whether the pods fit back on their seats together: restored one after another, then undone."""
    mark = session.checkpoint()
    try:
        for p in lost:
            if p.seat is None or not session.cluster.seat_free(p.spec, p.seat, bind=False):
                return False
            session.restore(p)
        return True
    finally:
        session.rollback(mark)


def test_an_elastic_victim_comes_back_after_its_gang() -> None:
    """Regression (a falsifying example of the property above, reduced): reclaim for t2's 2-GPU job takes t1's
    newest job first, `small` (3 pods of 0.25 GPU on n0, minMember 2: its elastic pod, then the rest of its
    gang), which frees too little, then one of `big`'s 2-GPU pods, which makes room. `small` is not needed and
    its seats stay free, so all three of its pods must come back; ranking each unit on its own request put the
    elastic pod (the smaller one) before the rest of its gang, where it could not come back alone, and left it
    evicted."""
    document = {
        "nodes": [node("n0", 1, cpu=4000), node("n1", 8, cpu=4000)],
        "queues": QUEUES,
        "jobs": [
            job(
                "big",
                "t1",
                [pod(f"big-{i}", 2, "n1") for i in range(4)],
                priority=10,
                min_member=1,
                created="2025-01-01T00:00:00Z",
            ),
            job("want", "t2", [pod("want-0", 2)], priority=10, created="2025-01-01T00:01:00Z"),
            job(
                "small",
                "t1",
                [pod(f"small-{i}", 0.25, "n0", gpuIndex=0) for i in range(3)],
                priority=10,
                min_member=2,
                created="2025-01-01T00:02:00Z",
            ),
        ],
    }
    session = run(document, ["reclaim"])
    states = {p.spec.name: p.state for p in session.pods}
    assert states["want-0"] == "pipelined"
    assert [n for n, s in states.items() if s == "evicted"] == ["big-3"]


def test_a_chunk_first_tries_what_earlier_victims_left_free() -> None:
    """Regression (a falsifying example of the property above, reduced): t3's elastic job `want` reclaims one
    0.25-GPU pod at a time. For want-0, t1's newest job `whole` (1 GPU on n1) goes; want-0 uses a quarter of it.
    For want-1 the rest of n1 is still free: KAI's first scenario has no new victims, so want-1 goes there too.
    Evicting first took `quarter` from the full n0, and binpack then put want-1 into its seat, so it could not
    come back although n1 had room all along."""
    t = "2025-01-01T00:0{}:00Z".format
    document = {
        "nodes": [node("n0", 1, cpu=4000), node("n1", 1, cpu=4000), node("n2", 4, cpu=4000)],
        "queues": QUEUES,
        "jobs": [
            job("big", "t1", [pod("big-0", 4, "n2")], priority=10, created=t(0)),
            job(
                "shared",
                "t1",
                [pod(f"shared-{i}", 0.25, "n0", gpuIndex=0) for i in range(3)],
                priority=10,
                created=t(1),
            ),
            job("quarter", "t1", [pod("quarter-0", 0.25, "n0", gpuIndex=0)], priority=10, created=t(2)),
            job("whole", "t1", [pod("whole-0", 1, "n1")], priority=10, created=t(3)),
            job("want", "t3", [pod(f"want-{i}", 0.25) for i in range(2)], priority=10, min_member=1, created=t(4)),
        ],
    }
    session = run(document, ["reclaim"])
    states = {p.spec.name: p.state for p in session.pods}
    assert states["want-0"] == states["want-1"] == "pipelined"
    assert [n for n, s in states.items() if s == "evicted"] == ["whole-0"]


def test_a_later_scenario_restores_an_earlier_victim() -> None:
    """Regression (falsifying examples of the property above, reduced): n0's one GPU is full; a later scenario
    frees more than it needs, and an earlier scenario's victim fits on its seat again, so it comes back.

    Across actions: reclaim takes t2's j0 (0.25) for t1's j2; preempt then takes t3's gang j1 (3 x 0.25) for
    t3's j3 (0.25), which leaves 0.5 free: j1 cannot come back (0.75), j0 can. Within one action: reclaim takes
    t2's j0 for t1's j2 (0.5), then t2's gang j1 (2 x 0.25) for t1's j3 (0.25): again j0 fits back, j1 not."""
    t = "2025-01-01T00:0{}:00Z".format
    across = {
        "nodes": [node("n0", 1, cpu=4000)],
        "queues": QUEUES,
        "jobs": [
            job("j0", "t2", [pod("j0-0", 0.25, "n0", gpuIndex=0)], priority=10, created=t(0)),
            job("j1", "t3", [pod(f"j1-{i}", 0.25, "n0", gpuIndex=0) for i in range(3)], priority=10, created=t(1)),
            job("j2", "t1", [pod("j2-0", 0.25)], priority=10, created=t(2)),
            job("j3", "t3", [pod("j3-0", 0.25)], priority=50, created=t(3)),
        ],
    }
    within = {
        "nodes": [node("n0", 1, cpu=4000)],
        "queues": QUEUES,
        "jobs": [
            job("j0", "t2", [pod("j0-0", 0.25, "n0", gpuIndex=0)], priority=10, created=t(0)),
            job("j1", "t2", [pod(f"j1-{i}", 0.25, "n0", gpuIndex=0) for i in range(2)], priority=50, created=t(1)),
            job("j2", "t1", [pod("j2-0", 0.5)], priority=10, created=t(2)),
            job("j3", "t1", [pod("j3-0", 0.25)], priority=10, created=t(3)),
        ],
    }
    for document, names in ((across, ["reclaim", "preempt"]), (within, ["reclaim"])):
        session = run(document, names)
        states = {p.spec.name: p.state for p in session.pods}
        assert states["j0-0"] == "running", names
        assert {states[n] for n in states if n.startswith("j1-")} == {"evicted"}, names
        assert states["j2-0"] != "pending" and states["j3-0"] != "pending", names
