"""Each arbiter action on small scenarios written from KAI's documented semantics."""

from __future__ import annotations

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.snapshot import parse_snapshot
from tests.unit.test_arbiter_support import cycle, doc, gang, job, node, placed, pod, queue

T0, T1, T2 = "2025-01-01T00:00:00Z", "2025-01-01T01:00:00Z", "2025-01-01T02:00:00Z"


# -- allocate ---------------------------------------------------------------------------------------------


def test_gang_is_bound_whole_or_not_at_all() -> None:
    result = cycle(
        doc([node("n1", 4), node("n2", 4)], [queue("q")], [gang("big", "q", 9), gang("fits", "q", 8, created=T1)]),
        "allocate",
    )
    assert placed(result, "big") == []
    assert all(result.pods[f"big-{i}"].outcome == "pending" for i in range(9))
    assert len(placed(result, "fits")) == 8


def test_elastic_job_grows_past_min_member_with_idle_gpus() -> None:
    result = cycle(doc([node("n", 4)], [queue("q")], [gang("e", "q", 6, min_member=2)]), "allocate")
    assert len(placed(result, "e")) == 4


def test_gang_below_min_member_goes_before_another_jobs_elastic_growth() -> None:
    jobs = [gang("elastic", "q", 4, min_member=1, created=T0), gang("strict", "q", 3, created=T1)]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "allocate")
    assert len(placed(result, "strict")) == 3
    assert len(placed(result, "elastic")) == 1


def test_job_order_in_a_queue_is_priority_then_age() -> None:
    jobs = [
        gang("old-low", "q", 2, priority=10, created=T0),
        gang("new-high", "q", 2, priority=60, created=T2),
        gang("old-high", "q", 2, priority=60, created=T1),
    ]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "allocate")
    assert placed(result, "old-high") and placed(result, "new-high")
    assert placed(result, "old-low") == []


def test_queue_below_its_quota_goes_first() -> None:
    jobs = [gang("a", "qa", 2, created=T0), gang("b", "qb", 2, created=T1)]
    queues = [queue("qa", quota=0), queue("qb", quota=2)]
    result = cycle(doc([node("n", 2)], queues, jobs), "allocate")
    assert placed(result, "b") and placed(result, "a") == []


def test_queue_with_higher_priority_goes_first_at_equal_standing() -> None:
    jobs = [gang("a", "qa", 2, created=T0), gang("b", "qb", 2, created=T1)]
    queues = [queue("qa", quota=0, priority=100), queue("qb", quota=0, priority=200)]
    result = cycle(doc([node("n", 2)], queues, jobs), "allocate")
    assert placed(result, "b") and placed(result, "a") == []


def test_queue_with_the_smaller_share_goes_first() -> None:
    # qa already runs 2 of its fair share; qb nothing: qb's job goes first
    jobs = [gang("run", "qa", 2, node="n1"), gang("a", "qa", 2, created=T0), gang("b", "qb", 2, created=T1)]
    queues = [queue("qa", quota=0), queue("qb", quota=0)]
    result = cycle(doc([node("n1", 2), node("n2", 2)], queues, jobs), "allocate")
    assert placed(result, "b") and placed(result, "a-") == []


def test_allocation_is_work_conserving_beyond_fair_share() -> None:
    result = cycle(doc([node("n", 8)], [queue("a", quota=1), queue("b", quota=7)], [gang("ja", "a", 8)]), "allocate")
    assert len(placed(result, "ja")) == 8
    assert result.fair_share["a"][0] == 8000


def test_limit_is_enforced_at_every_ancestor() -> None:
    queues = [queue("dept", limit=3), queue("team", parent="dept")]
    jobs = [gang("first", "team", 2, created=T0), gang("second", "team", 2, created=T1)]
    result = cycle(doc([node("n", 8)], queues, jobs), "allocate")
    assert len(placed(result, "first")) == 2
    assert placed(result, "second") == []  # 4 > the parent's limit of 3, though the leaf is unlimited


def test_non_preemptible_job_only_runs_within_quota() -> None:
    queues = [queue("q", quota=2)]
    jobs = [gang("inference", "q", 3, priority=125), gang("small", "q", 2, priority=125, created=T1)]
    result = cycle(doc([node("n", 8)], queues, jobs), "allocate")
    assert placed(result, "inference") == []  # 3 GPUs > quota 2, idle GPUs notwithstanding
    assert len(placed(result, "small")) == 2


def test_non_preemptible_quota_is_checked_at_ancestors() -> None:
    queues = [queue("dept", quota=2), queue("team", parent="dept", quota=-1)]
    result = cycle(doc([node("n", 8)], queues, [gang("inf", "team", 3, priority=125)]), "allocate")
    assert placed(result, "inf") == []


def test_binpack_fills_the_busiest_node_and_spread_the_emptiest() -> None:
    nodes = [node("busy", 4), node("idle", 4)]
    jobs = [gang("run", "q", 2, node="busy"), gang("new", "q", 1)]
    binpack = cycle(doc(nodes, [queue("q")], jobs, gpu="binpack"), "allocate")
    spread = cycle(doc(nodes, [queue("q")], jobs, gpu="spread"), "allocate")
    assert binpack.pods["new-0"].node == "busy"
    assert spread.pods["new-0"].node == "idle"


def test_fgd_keeps_room_for_the_multi_gpu_pods_the_workload_runs() -> None:
    # a1 has 5 GPUs free, b1 4; a one-GPU pod comes first, then two 4-GPU pods. Binpack puts the one-GPU pod on
    # the tighter b1 and leaves room for only one of them; fgd (the default) sees that 4-GPU pods are part of
    # the workload, takes a1's fifth GPU instead, and both 4-GPU pods run.
    nodes = [node("a1", 8), node("b1", 8)]
    jobs = [
        gang("run-a", "q", 3, node="a1"),
        gang("run-b", "q", 4, node="b1"),
        gang("one", "q", 1, priority=60, created=T0),
        job("four-x", "q", [pod("four-x-0", 4)], created=T1),
        job("four-y", "q", [pod("four-y-0", 4)], created=T2),
    ]
    fgd = cycle(doc(nodes, [queue("q")], jobs), "allocate")
    binpack = cycle(doc(nodes, [queue("q")], jobs, gpu="binpack"), "allocate")
    assert fgd.pods["one-0"].node == "a1"
    assert {fgd.pods["four-x-0"].node, fgd.pods["four-y-0"].node} == {"a1", "b1"}
    assert binpack.pods["one-0"].node == "b1"
    assert placed(binpack, "four-") == ["four-x-0"]


def test_fgd_puts_a_share_on_a_used_gpu_before_opening_a_fresh_one() -> None:
    jobs = [job("r", "q", [pod("r-0", 0.5, node="n2", gpuIndex=1)]), job("f", "q", [pod("f-0", 0.5)], created=T1)]
    result = cycle(doc([node("n1", 2), node("n2", 2)], [queue("q")], jobs), "allocate")
    assert (result.pods["f-0"].node, result.pods["f-0"].gpu_index) == ("n2", 1)


def test_fractional_pods_share_one_gpu() -> None:
    jobs = [job("f", "q", [pod("f-0", 0.5), pod("f-1", 0.5), pod("f-2", 0.5)], min_member=1)]
    result = cycle(doc([node("n", 2)], [queue("q")], jobs), "allocate")
    indices = [result.pods[f"f-{i}"].gpu_index for i in range(3)]
    assert sorted(indices, key=str) == [0, 0, 1] or sorted(indices, key=str) == [0, 1, 1]


def test_fractional_pod_joins_the_running_share_on_its_gpu() -> None:
    jobs = [
        job("r", "q", [pod("r-0", 0.5, node="n", gpuIndex=1)]),
        job("f", "q", [pod("f-0", 0.5)], created=T1),
        job("w", "q", [pod("w-0", 1)], created=T2),
    ]
    result = cycle(doc([node("n", 2)], [queue("q")], jobs), "allocate")
    assert result.pods["f-0"].gpu_index == 1
    assert result.pods["w-0"].action == "bind"  # GPU 0 stays whole for it


def test_node_selector_must_match_labels() -> None:
    nodes = [node("a100", 8, labels={"gpu": "a100"}), node("h100", 8, labels={"gpu": "h100"})]
    jobs = [job("j", "q", [pod("j-0", 1, nodeSelector={"gpu": "h100"})])]
    result = cycle(doc(nodes, [queue("q")], jobs), "allocate")
    assert result.pods["j-0"].node == "h100"


def test_gang_members_on_one_node_stay_inside_one_nvlink_domain() -> None:
    n = node("n", 8, nvlinkDomains=[[0, 1, 2, 3], [4, 5, 6, 7]])
    jobs = [job("run", "q", [pod("run-0", 1, node="n")]), gang("g", "q", 4, created=T1)]
    session_doc = doc([n], [queue("q")], jobs)
    from agent.arbiter.core.allocate import allocate
    from agent.arbiter.core.session import Session

    session = Session(parse_snapshot(session_doc))
    allocate(session)
    gpus = {g for p in session.pods if p.job.spec.name == "g" and p.seat for g in p.seat.gpus}
    assert gpus == {4, 5, 6, 7}  # GPU 0 is taken, so the gang goes whole into the other domain


def test_pods_being_released_are_promised_to_a_pending_gang() -> None:
    jobs = [job("leaving", "q", [pod("l-0", 4, node="n", status="Releasing")]), gang("g", "q", 2, gpus=2)]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "allocate")
    assert result.pods["l-0"].outcome == "evicted"
    assert [result.pods[f"g-{i}"].action for i in range(2)] == ["pipeline", "pipeline"]
    assert all(result.pods[f"g-{i}"].node == "n" for i in range(2))


def test_gang_that_needs_a_release_waits_whole() -> None:
    nodes = [node("a", 2), node("b", 2)]
    jobs = [job("leaving", "q", [pod("l-0", 2, node="b", status="Releasing")]), gang("g", "q", 2, gpus=2)]
    result = cycle(doc(nodes, [queue("q")], jobs), "allocate")
    assert {result.pods["g-0"].action, result.pods["g-1"].action} == {"pipeline"}


# -- consolidate ------------------------------------------------------------------------------------------


def test_consolidate_moves_a_small_pod_so_a_whole_node_job_fits() -> None:
    nodes = [node("n1", 4), node("n2", 4)]
    jobs = [
        gang("a", "q", 1, node="n1", gpus=2),
        gang("b", "q", 1, node="n2", gpus=1),
        gang("big", "q", 1, gpus=4, created=T1),
    ]
    result = cycle(doc(nodes, [queue("q")], jobs), "allocate,consolidate")
    assert result.pods["big-0"].action == "pipeline"
    moved = [n for n, d in result.pods.items() if d.action == "evict"]
    assert len(moved) == 1
    decision = result.pods[moved[0]]
    assert decision.moved_to is not None and decision.moved_to != decision.node
    assert decision.cause == "consolidate"


def test_consolidate_does_nothing_when_moved_pods_could_not_be_replaced() -> None:
    nodes = [node("n1", 4), node("n2", 4)]
    jobs = [
        gang("a", "q", 1, node="n1", gpus=3),
        gang("b", "q", 1, node="n2", gpus=3),
        gang("big", "q", 1, gpus=2, created=T1),
    ]
    result = cycle(doc(nodes, [queue("q")], jobs), "allocate,consolidate")
    assert all(d.action == "keep" for d in result.pods.values())


def test_consolidate_never_moves_non_preemptible_pods() -> None:
    nodes = [node("n1", 4), node("n2", 4)]
    jobs = [
        gang("a", "q", 1, node="n1", gpus=2, priority=125),
        gang("b", "q", 1, node="n2", gpus=2, priority=125),
        gang("big", "q", 1, gpus=4, created=T1),
    ]
    result = cycle(doc(nodes, [queue("q", quota=8)], jobs), "allocate,consolidate")
    assert all(d.action == "keep" for d in result.pods.values())


# -- reclaim ----------------------------------------------------------------------------------------------


def _reclaim_doc(victim_min: int) -> dict[str, object]:
    queues = [queue("a", quota=4), queue("b", quota=4)]
    jobs = [gang("ja", "a", 8, node="n", min_member=victim_min), gang("jb", "b", 2, created=T1)]
    return doc([node("n", 8)], queues, jobs)


def test_reclaim_takes_back_from_a_queue_above_its_fair_share() -> None:
    result = cycle(_reclaim_doc(victim_min=1), "reclaim")
    assert placed(result, "jb", "pipeline") == ["jb-0", "jb-1"]
    evicted = placed(result, "ja", "evict")
    assert len(evicted) == 2  # only as much as the reclaimer needs
    assert all(result.pods[p].cause == "reclaim" for p in evicted)


def test_reclaim_takes_a_gang_whole_judging_its_queue_before_it_leaves() -> None:
    # KAI reclaimable.go reclaimResourcesFromReclaimees: the victim queue is judged on its allocation before the
    # victim leaves (a holds 8 > max(quota 4, fair share 6)), so the 8-pod gang is eligible; a gang is never
    # broken, so all 8 go, and none fits back beside the reclaimer's 2 (strategies.go FitsMaintainFairShare)
    result = cycle(_reclaim_doc(victim_min=8), "reclaim")
    assert len(placed(result, "ja", "evict")) == 8
    assert placed(result, "jb", "pipeline") == ["jb-0", "jb-1"]


def test_reclaim_is_refused_to_a_queue_that_would_exceed_its_fair_share() -> None:
    queues = [queue("a", quota=6), queue("b", quota=2, weight=0)]
    jobs = [gang("ja", "a", 8, node="n", min_member=1), gang("jb", "b", 3, created=T1)]
    result = cycle(doc([node("n", 8)], queues, jobs), "reclaim")
    assert placed(result, "jb", "pipeline") == []  # 3 > b's fair share of 2


def test_reclaim_respects_hierarchy_fair_shares() -> None:
    # dept-x (quota 4) runs everything through team x1; dept-y's team reclaims up to dept-y's fair share
    queues = [queue("x", quota=4), queue("x1", parent="x"), queue("y", quota=4), queue("y1", parent="y")]
    jobs = [gang("jx", "x1", 8, node="n", min_member=1), gang("jy", "y1", 4, created=T1)]
    result = cycle(doc([node("n", 8)], queues, jobs), "reclaim")
    assert len(placed(result, "jy", "pipeline")) == 4
    assert len(placed(result, "jx", "evict")) == 4


def test_reclaim_never_evicts_non_preemptible_jobs() -> None:
    queues = [queue("a", quota=4), queue("b", quota=4)]
    jobs = [gang("ja", "a", 8, node="n", min_member=1, priority=125, preemptible=False), gang("jb", "b", 2)]
    result = cycle(doc([node("n", 8)], queues, jobs), "reclaim")
    assert all(d.action == "keep" for d in result.pods.values())


# -- preempt ----------------------------------------------------------------------------------------------


def test_preempt_evicts_strictly_lower_priority_in_the_same_queue() -> None:
    jobs = [gang("low", "q", 4, node="n", priority=10), gang("high", "q", 4, priority=60, created=T1)]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "preempt")
    assert len(placed(result, "low", "evict")) == 4
    assert len(placed(result, "high", "pipeline")) == 4
    assert all(result.pods[f"low-{i}"].cause == "preempt" for i in range(4))


def test_preempt_spares_equal_priority_and_other_queues() -> None:
    jobs = [
        gang("same", "q", 2, node="n", priority=60),
        gang("other", "r", 2, node="n", priority=10),
        gang("high", "q", 2, priority=60, created=T1),
    ]
    result = cycle(doc([node("n", 4)], [queue("q"), queue("r")], jobs), "preempt")
    assert all(d.action == "keep" for d in result.pods.values())


def test_preempt_takes_the_cheapest_victims_first() -> None:
    jobs = [
        gang("p20", "q", 2, node="n", priority=20),
        gang("p10", "q", 2, node="n", priority=10),
        gang("high", "q", 2, priority=60, created=T1),
    ]
    result = cycle(doc([node("n", 4)], [queue("q")], jobs), "preempt")
    assert placed(result, "p10", "evict") == ["p10-0", "p10-1"]
    assert placed(result, "p20", "evict") == []


def test_rounds_turn_pipelined_pods_into_running_ones() -> None:
    from agent.simulation.rounds import simulate

    jobs = [gang("low", "q", 4, node="n", priority=10), gang("high", "q", 4, priority=60, created=T1)]
    sim = simulate(
        parse_snapshot(doc([node("n", 4)], [queue("q")], jobs)), ["allocate", "preempt"], 2, iter(range(100)).__next__
    )
    assert [sim.last.pods[f"high-{i}"].action for i in range(4)] == ["bind"] * 4
    assert sim.cycle_seconds == (1, 1)
    again = run_cycle(sim.last.next, ["allocate"])
    assert all(again.pods[f"high-{i}"].outcome == "running" for i in range(4))
