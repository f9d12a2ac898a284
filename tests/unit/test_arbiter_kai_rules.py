"""KAI-Scheduler's semantic rules, one scenario each (our own scenarios; the KAI file and function each follows
is named in the test). KAI = kai-scheduler/KAI-Scheduler, pkg/scheduler."""

from __future__ import annotations

from typing import Any

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.evict import eligible, may_reclaim, reclaimers_within_boundaries
from agent.arbiter.core.model import MILLI
from agent.arbiter.core.session import QueueRank, Session
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_support import GIB, cycle, doc, gang, job, node, placed, pod, queue

G = MILLI
T0 = "2025-01-01T00:00:00Z"
LATER = "2025-01-02T00:00:00Z"
NOW = "2025-01-01T12:00:00Z"


def _evicted(result: Any) -> list[str]:
    return sorted(n for n, d in result.pods.items() if d.outcome == "evicted")


# -- rule 1: reclaim victim eligibility (plugins/proportion/reclaimable/reclaimable.go, strategies.go) ------


def test_victims_are_compared_where_the_branches_meet_not_leaf_to_leaf() -> None:
    # dept x (quota 2) runs 6 through team x1, whose own quota (6) it is within; dept y's team wants 4. At the
    # level where the branches meet (the departments), x is above max(quota, fair share): x1's pods are
    # victims although x1 is at its quota (reclaimable.go getLeveledQueues + FitsMaintainFairShare)
    queues = [
        queue("x", quota=2, weight=0),
        queue("x1", parent="x", quota=6),
        queue("y", quota=4, weight=0),
        queue("y1", parent="y", quota=4),
    ]
    jobs = [*(gang(f"x{i}", "x1", 1, node="n") for i in range(6)), gang("want", "y1", 4, created=LATER)]
    result = cycle(doc([node("n", 6)], queues, jobs), "reclaim")
    assert len(placed(result, "want", "pipeline")) == 4
    assert len(_evicted(result)) == 4


def test_a_queue_at_its_quota_is_never_a_victim_even_for_a_starved_reclaimer() -> None:
    # a holds exactly its quota 4 (and its fair share); b is starved (0 of quota 4) but a is no victim: neither
    # strategy allows it (strategies.go: MaintainFairShare needs a above max(quota, fair share),
    # GuaranteeDeservedQuota needs a above its quota)
    queues = [queue("a", quota=4, weight=0), queue("b", quota=4, weight=0)]
    jobs = [*(gang(f"a{i}", "a", 1, node="n") for i in range(4)), gang("want", "b", 2, created=LATER)]
    result = cycle(doc([node("n", 4)], queues, jobs), "reclaim")
    assert _evicted(result) == [] and placed(result, "want", "pipeline") == []


def test_guarantee_deserved_quota_lets_a_reclaimer_within_quota_take_from_a_queue_above_quota() -> None:
    # strategies.go GuaranteeDeservedQuotaStrategy: the reclaimer stays within its quota with the job and the
    # victim side is above its quota, even where the victim is not above its fair share
    session = Session(
        parse_snapshot(
            doc(
                [node("n", 8)],
                [queue("a", quota=2), queue("b", quota=4, weight=0)],
                [*(gang(f"a{i}", "a", 1, node="n") for i in range(4)), gang("want", "b", 2, created=LATER)],
            )
        )
    )
    a, b = (next(q for q in session.queues if q.spec.name == name) for name in ("a", "b"))
    a.fair = (4.0 * G, a.fair[1], a.fair[2])  # a at its fair share (4) but above its quota (2)
    a.allocatable = (4.0 * G, a.allocatable[1], a.allocatable[2])
    assert eligible(b, (2.0 * G, 0.0, 0.0), a)  # b: 0 + 2 <= quota 4
    assert not eligible(b, (5.0 * G, 0.0, 0.0), a)  # 0 + 5 > quota 4, and a is not above its fair share


# -- rule 5: the reclaimer's ancestors (reclaimable.go reclaimingQueuesRemainWithinBoundaries) -------------


def _departments() -> Session:
    # two departments x and y; y's teams y1 and y2, x's team x1
    queues = [
        queue("x", quota=2),
        queue("x1", parent="x"),
        queue("y", quota=2),
        queue("y1", parent="y", quota=2, weight=0),
        queue("y2", parent="y", quota=0),
    ]
    jobs = [*(gang(f"x{i}", "x1", 1, node="n") for i in range(6)), gang("want", "y1", 2, created=LATER)]
    return Session(parse_snapshot(doc([node("n", 8)], queues, jobs)))


def _set(session: Session, name: str, alloc: float, fair: float) -> None:
    q = next(q for q in session.queues if q.spec.name == name)
    q.alloc[0] = alloc * G
    q.fair = (fair * G, q.fair[1], q.fair[2])


def test_only_the_reclaimers_leaf_must_stay_within_its_fair_share() -> None:
    # reclaimable.go CanReclaimResources looks at the reclaimer's own queue; y already above its fair share
    # does not stop y1
    session = _departments()
    want = next(j for j in session.jobs if j.spec.name == "want")
    _set(session, "y", alloc=5, fair=4)
    _set(session, "y1", alloc=0, fair=2)
    assert may_reclaim(want, (2.0 * G, 0.0, 0.0))
    _set(session, "y1", alloc=1, fair=2)
    assert not may_reclaim(want, (2.0 * G, 0.0, 0.0))


def test_an_ancestor_above_fair_share_must_stay_strictly_below_the_victim_siblings_saturation() -> None:
    # reclaimable.go isFairShareSaturationLowerPerResource, after the reclaim (the chunk placed, the victims gone)
    session = _departments()
    want = next(j for j in session.jobs if j.spec.name == "want")
    victims = [[p] for p in session.pods if p.job.queue.spec.name == "x1"][:2]
    for unit in victims:
        session.evict(unit[0], "reclaim")
    _set(session, "y1", alloc=2, fair=2)
    _set(session, "y", alloc=6, fair=5)  # saturation 1.2
    _set(session, "x", alloc=6, fair=4)  # 1.5: y stays below
    assert reclaimers_within_boundaries(session, want, (2.0 * G, 0.0, 0.0), victims)
    _set(session, "x", alloc=6, fair=5)  # 1.2: not strictly below
    assert not reclaimers_within_boundaries(session, want, (2.0 * G, 0.0, 0.0), victims)
    _set(session, "y", alloc=5, fair=5)  # y within its fair share: no comparison needed
    assert reclaimers_within_boundaries(session, want, (2.0 * G, 0.0, 0.0), victims)


# -- rule 4: preempt checks the limit after the victims leave (actions/preempt/preempt.go) -----------------


def test_preempt_within_a_full_limited_queue_checks_the_limit_after_the_victims_leave() -> None:
    queues = [queue("q", limit=4)]
    jobs = [gang("low", "q", 4, node="n", priority=10), gang("high", "q", 2, priority=60, created=LATER)]
    result = cycle(doc([node("n", 8)], queues, jobs), "preempt")
    assert len(placed(result, "high", "pipeline")) + len(placed(result, "high", "bind")) == 2
    assert len(_evicted(result)) == 4  # the 4-pod gang goes whole; 2 + 4 would breach the limit, so none returns
    assert result.allocated["q"][0] <= 4 * G


def test_a_non_preemptible_preemptor_over_quota_is_refused_up_front() -> None:
    jobs = [gang("low", "q", 4, node="n", priority=10), gang("svc", "q", 2, priority=125, created=LATER)]
    result = cycle(doc([node("n", 4)], [queue("q", quota=1)], jobs), "preempt")
    assert _evicted(result) == []


# -- rule 2: victims go back through allocation (actions/common/solvers) ----------------------------------


def test_a_victim_that_still_fits_stays() -> None:
    # two elastic victims; the reclaimer needs one GPU: the second evicted pod is put back
    jobs = [
        job("low", "q", [pod(f"low-{i}", 1, "n") for i in range(4)], priority=10, min_member=1),
        gang("high", "q", 1, priority=60, created=LATER),
    ]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "preempt")
    assert len(_evicted(result)) == 1


def test_a_victim_never_comes_back_in_breach_of_its_queues_limit() -> None:
    # q's limit is 4 and an elastic low job holds all 4 on an 8-GPU node; high wants 2. With free GPUs beside
    # them every victim would fit back, but only as many return as the limit allows: exactly 2 stay evicted
    jobs = [
        job("low", "q", [pod(f"low-{i}", 1, "n") for i in range(4)], priority=10, min_member=1),
        gang("high", "q", 2, priority=60, created=LATER),
    ]
    result = cycle(doc([node("n", 8)], [queue("q", limit=4)], jobs), "preempt")
    assert len(_evicted(result)) == 2
    assert result.allocated["q"][0] == 4 * G


# -- rule 3: consolidation (actions/consolidation/consolidation.go) ----------------------------------------


def test_consolidation_takes_the_newest_lowest_priority_job_first_and_may_move_it_on_its_own_node() -> None:
    # n has two GPUs, each half used by a different job; a whole-GPU job waits. Moving the newer half-GPU pod
    # onto the other GPU of the same node frees one device
    jobs = [
        job("old", "q", [pod("old-0", 0.5, "n", gpuIndex=0)], created=T0),
        job("new", "q", [pod("new-0", 0.5, "n", gpuIndex=1)], created="2025-01-01T01:00:00Z"),
        gang("whole", "q", 1, created=LATER),
    ]
    result = cycle(doc([node("n", 2)], [queue("q")], jobs), "consolidate")
    moved = result.pods["new-0"]
    assert moved.action == "evict" and moved.moved_to == "n"
    assert result.pods["old-0"].action == "keep"
    assert result.pods["whole-0"].action == "pipeline"


# -- rule 7: queue order tie-breaks (plugins/proportion/queue_order/queue_order.go) ------------------------


def test_equal_shares_with_the_job_fall_back_to_the_share_without_it() -> None:
    # prioritizeSmallerResourceShareWithoutTask: a (1 running + 3 asked) and b (3 + 1) reach the same dominant
    # share with their jobs (4 of an allocatable 4); a holds less without its job, so a goes first
    queues = [queue("b", quota=0), queue("a", quota=0)]
    jobs = [
        gang("ra", "a", 1, node="n"),
        *(gang(f"rb{i}", "b", 1, node="n") for i in range(3)),
        gang("wa", "a", 3, created=LATER),
        gang("wb", "b", 1, created=LATER),
    ]
    session = Session(parse_snapshot(doc([node("n", 8)], queues, jobs)))
    b, a = session.queues
    assert a.allocatable[0] == b.allocatable[0] == 4 * G
    key_a, key_b = QueueRank(a, (3.0 * G, 3000.0, 3 * GIB)), QueueRank(b, (1.0 * G, 1000.0, GIB))
    tied = ("over", "outside", "priority", "penalised", "with_job")
    assert [getattr(key_a, f) for f in tied] == [getattr(key_b, f) for f in tied]  # equal up to the share with it
    assert key_a.before(key_b) and not key_b.before(key_a)


def test_a_queue_with_no_allocatable_share_of_what_it_asks_for_goes_last() -> None:
    # penalizeZeroShareWithJob: z's GPU limit is 0, so its allocatable GPU share is 0; asking for a GPU it is
    # ranked after w, although its dominant share (nothing held) would be the smaller
    queues = [queue("w", quota=0), queue("z", quota=0, limit=0)]
    jobs = [gang("run", "w", 2, node="n"), gang("wz", "z", 1, created=T0), gang("ww", "w", 1, created=LATER)]
    session = Session(parse_snapshot(doc([node("n", 4)], queues, jobs)))
    w, z = (next(q for q in session.queues if q.spec.name == n) for n in ("w", "z"))
    assert QueueRank(w, (1.0 * G, 0.0, 0.0)).before(QueueRank(z, (1.0 * G, 0.0, 0.0)))


def test_the_weaker_allocatable_share_breaks_the_last_tie_before_age() -> None:
    # prioritizeBasedOnAllocatableShare: with every share equal (nothing allocated, nothing asked), the queue
    # with the smaller allocatable share in every resource goes first, though it is the younger one
    queues = [queue("big", quota=6), queue("small", quota=2)]
    session = Session(parse_snapshot(doc([node("n", 8)], queues, [gang("x", "big", 6), gang("y", "small", 2)])))
    big, small = session.queues
    zero = (0.0, 0.0, 0.0)
    assert QueueRank(small, zero).before(QueueRank(big, zero))


# -- rule 8: equally scored nodes in node-name order -------------------------------------------------------


def test_equally_scored_nodes_are_tried_in_node_name_order() -> None:
    nodes = [node("node-c", 4), node("node-a", 4), node("node-b", 4)]
    result = cycle(doc(nodes, [queue("q")], [gang("one", "q", 1)]), "allocate")
    assert result.pods["one-0"].node == "node-a"


# -- protections (plugins/minruntime/minruntime.go; KAI v0.17 preemption delay) ----------------------------


def _runtime_doc(started: str, reclaim_min: str = "10m", min_member: int = 4) -> dict[str, Any]:
    queues = [queue("a", quota=0, reclaimMinRuntime=reclaim_min), queue("b", quota=4, weight=0)]
    victim = job("ja", "a", [pod(f"ja-{i}", 1, "n") for i in range(4)], min_member=min_member)
    victim["startedAt"] = started
    document = doc([node("n", 4)], queues, [victim, gang("want", "b", 2, created=LATER)])
    document["now"] = NOW
    return document


def test_a_job_younger_than_the_reclaim_min_runtime_is_no_victim() -> None:
    assert _evicted(cycle(_runtime_doc("2025-01-01T11:55:00Z"), "reclaim")) == []
    assert len(_evicted(cycle(_runtime_doc("2025-01-01T11:00:00Z"), "reclaim"))) == 4


def test_a_protected_elastic_job_gives_only_its_pods_above_min_member() -> None:
    result = cycle(_runtime_doc("2025-01-01T11:55:00Z", min_member=2), "reclaim")
    assert len(_evicted(result)) == 2 and len(placed(result, "want", "pipeline")) == 2


def inherited_protection(high_created: str) -> dict[str, Any]:
    """low (priority 10) started 11:30 in team, under a dept whose preemptMinRuntime is 1 h; high (60), created
    at `high_created`, waits beside it; the clock reads NOW (12:00)."""
    queues = [queue("dept", preemptMinRuntime="1h"), queue("team", parent="dept")]
    low = gang("low", "team", 2, node="n", priority=10)
    low["startedAt"] = "2025-01-01T11:30:00Z"
    document = doc([node("n", 2)], queues, [low, gang("high", "team", 2, priority=60, created=high_created)])
    document["now"] = NOW
    return document


def test_preempt_min_runtime_is_inherited_from_the_parent_queue() -> None:
    assert _evicted(cycle(inherited_protection(LATER), "preempt")) == []


def test_a_pending_job_within_its_preemption_delay_evicts_no_one() -> None:
    def attempt(pending_since: str) -> list[str]:
        high = gang("high", "q", 2, priority=60, created=T0)
        high["preemptionDelay"] = "5m"
        high["pendingSince"] = pending_since
        document = doc([node("n", 2)], [queue("q")], [gang("low", "q", 2, node="n", priority=10), high])
        document["now"] = NOW
        return _evicted(cycle(document, "preempt"))

    assert attempt("2025-01-01T11:58:00Z") == []
    assert attempt("2025-01-01T11:50:00Z") == ["low-0", "low-1"]


# -- time-aware fair share (KAI v0.10; resource_division.go calcShareWeights) ------------------------------


def test_past_usage_moves_over_quota_share_to_the_queue_that_used_less() -> None:
    queues = [queue("a", quota=0), queue("b", quota=0)]
    jobs = [gang("ja", "a", 8), gang("jb", "b", 8)]
    plain = cycle(doc([node("n", 8)], queues, jobs), "allocate")
    assert plain.fair_share["a"][0] == plain.fair_share["b"][0] == 4 * G
    aware = doc([node("n", 8)], queues, jobs)
    aware["now"] = NOW
    aware["fairness"] = {
        "windowSize": "12h",
        "halfLife": "3h",
        "kValue": 1,
        "history": [{"queue": "a", "start": T0, "end": NOW, "gpus": 8}],
    }
    result = cycle(aware, "allocate")
    assert result.fair_share["b"][0] > result.fair_share["a"][0]
    assert result.fair_share["a"][0] + result.fair_share["b"][0] == 8 * G


def test_usage_never_touches_the_in_quota_part() -> None:
    queues = [queue("a", quota=3), queue("b", quota=1)]
    document = doc([node("n", 8)], queues, [gang("ja", "a", 8), gang("jb", "b", 8)])
    document["fairness"] = {"usage": {"a": {"gpu": 1.0}}, "kValue": 5}
    result = cycle(document, "allocate")
    assert result.fair_share["a"][0] >= 3 * G  # deserved stays, however much a used


def test_metrics_report_usage_and_the_protections_in_force() -> None:
    from prometheus_client import CollectorRegistry

    from agent.arbiter.metrics import ArbiterMetrics, cycle_values

    document = _runtime_doc("2025-01-01T11:55:00Z")
    document["fairness"] = {"usage": {"a": {"gpu": 0.25}}}
    result = cycle(document, "reclaim")
    registry = CollectorRegistry()
    ArbiterMetrics(registry).record(cycle_values(result, now=0.0, cycle_seconds=0.01))
    assert registry.get_sample_value("gpu_arbiter_queue_usage", {"queue": "a", "resource": "gpu"}) == 0.25
    assert (
        registry.get_sample_value("gpu_arbiter_protected_jobs", {"queue": "a", "protection": "reclaimMinRuntime"}) == 1
    )


# -- KAI's own scenario (actions/integration_tests/reclaim/reclaim_test.go getReclaimTestsMetadata, the tenth
# entry: "... 1 job recalim from different project - reclaim from less prioritized queue") -------------------


def test_reclaim_from_the_less_prioritized_queue_and_the_outcome_holds() -> None:
    # one node of 4 GPUs; queues under a default parent: queue0 and queue1 (priority 100, quota 1, weight 1) and
    # queue2 (priority 101, quota 1, weight 0). queue0 runs 2 jobs, queue2 runs 2, queue1's job waits. KAI's
    # harness runs allocate, consolidate, reclaim, preempt for two rounds, then five more that must change
    # nothing; between rounds an evicted or pipelined pod is pending again (as `CycleResult.next` moves it).
    # Round two is the case: running_job1 waits again and queue2 (above its fair share of 1) is a valid victim,
    # but KAI's solver puts the preemptor and the victims back through allocation together in queue order
    # (actions/common/action.go TryToVirtuallyAllocatePreemptorAndGetVictims): queue2's higher priority gives
    # its evicted job the GPU back first, running_job1 no longer fits, and nothing is evicted
    def one(name: str, q: str, age_min: int, node: str | None = None) -> dict[str, Any]:
        created = f"2025-01-01T00:{10 - age_min:02d}:00Z"  # KAI's ages: running_job0 5 min ... pending_job0 1
        return job(name, q, [pod(f"{name}-0", 1, node, cpu=0, mem=0)], priority=50, created=created)

    queues = [
        queue("default"),
        queue("queue0", parent="default", quota=1, weight=1),
        queue("queue1", parent="default", quota=1, weight=1),
        queue("queue2", parent="default", quota=1, weight=0, priority=101),
    ]
    jobs = [
        one("running_job0", "queue0", 5, "node0"),
        one("running_job1", "queue0", 4, "node0"),
        one("running_job2", "queue2", 3, "node0"),
        one("running_job3", "queue2", 2, "node0"),
        one("pending_job0", "queue1", 1),
    ]
    snapshot = parse_snapshot(doc([node("node0", 4, cpu=0, mem=0)], queues, jobs))
    evicted: list[str] = []
    for _ in range(2 + 5):
        result = run_cycle(snapshot, ["allocate", "consolidate", "reclaim", "preempt"])
        evicted += _evicted(result)
        snapshot = result.next
    assert evicted == ["running_job1-0"]  # queue0 gives its newer job; queue2 keeps both of its own
    state = {p.name: p.status for j in snapshot.jobs for p in j.pods}
    assert state == {
        "running_job0-0": "Running",
        "running_job1-0": "Pending",
        "running_job2-0": "Running",
        "running_job3-0": "Running",
        "pending_job0-0": "Running",
    }
