"""A gang whose pods share a ComputeDomain runs inside one multi-node NVLink clique or not at all (issue 36,
item 4): IMEX joins the nodes of one clique only, so pods spread over two cliques cannot talk over NVLink."""

from __future__ import annotations

from dataclasses import replace

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.model import Snapshot
from agent.arbiter.core.snapshot import parse_snapshot
from agent.arbiter.waiting import NO_RESERVATIONS, wait_reasons
from tests.unit.test_arbiter_support import doc, gang, node, queue


def rack(cliques: dict[str, int], jobs: list[dict], *, loose: int = 0) -> Snapshot:
    """Nodes of 4 GPUs, `cliques` clique -> its nodes, then `loose` nodes in no clique."""
    names = {f"{c}-n{i}": c for c, count in cliques.items() for i in range(count)}
    nodes = [node(n, 4) for n in names] + [node(f"loose-n{i}", 4) for i in range(loose)]
    snap = parse_snapshot(doc(nodes, [queue("q")], jobs))
    return replace(
        snap,
        nodes=tuple(replace(n, clique=names.get(n.name)) for n in snap.nodes),
        jobs=tuple(replace(j, one_clique=j.name.startswith("cd")) for j in snap.jobs),
    )


def placement(result, prefix: str) -> dict[str, str | None]:
    return {name: d.node for name, d in result.pods.items() if name.startswith(prefix)}


def test_a_domain_gang_that_fits_no_single_clique_waits_and_says_why() -> None:
    # 4 pods x 4 GPUs: 16 GPUs, and the two cliques have 12 each (24 in all, which a gang of no domain fits)
    snap = rack({"a": 3, "b": 3}, [gang("cd-train", "q", 4, gpus=4)])
    result = run_cycle(snap, ["allocate", "consolidate", "reclaim", "preempt"])
    assert all(d.outcome == "pending" for d in placement_decisions(result, "cd-train"))
    assert wait_reasons(snap, result)["cd-train"] == (
        "no fit in one NVLink clique for the 4 pod(s) of a ComputeDomain needing 16 GPUs: 0/6 nodes are available: "
        "6 node(s) in a clique too small for the gang's 16 GPUs (the largest has 12)."
    )

    plain = replace(snap, jobs=tuple(replace(j, one_clique=False) for j in snap.jobs))
    assert all(d.outcome == "running" for d in run_cycle(plain, ["allocate"]).pods.values())  # tried: it fits


def test_a_domain_gang_goes_whole_into_the_clique_that_fits_it() -> None:
    snap = rack({"a": 3, "b": 4}, [gang("cd-train", "q", 4, gpus=4)])
    where = placement(run_cycle(snap, ["allocate"]), "cd-train")
    assert sorted(n or "" for n in where.values()) == [f"b-n{i}" for i in range(4)]


def test_nodes_in_no_clique_are_not_offered() -> None:
    snap = rack({"a": 2}, [gang("cd-train", "q", 3, gpus=4)], loose=4)
    result = run_cycle(snap, ["allocate"])
    assert all(d.node is None for d in result.pods.values())
    assert wait_reasons(snap, result)["cd-train"] == (
        "no fit in one NVLink clique for the 3 pod(s) of a ComputeDomain needing 12 GPUs: 0/6 nodes are available: "
        "2 node(s) in a clique too small for the gang's 12 GPUs (the largest has 8), "
        "4 node(s) offer no IMEX channel (in no complete, undegraded NVLink fabric clique)."
    )


def test_a_clique_held_by_running_pods_says_what_preemption_found() -> None:
    """Tried: clique a (16 GPUs) has one node busy with a non-preemptible gang, clique b is too small, and one
    node publishes GPUs without serving reservations. Each node is counted once under its cause, sorted as
    kube-scheduler sorts them, and the nodes where evicting could have helped are told apart in the preemption
    part."""
    busy = gang("busy", "q", 1, gpus=4, preemptible=False)
    busy["pods"][0].update(node="a-n0", status="Running")
    snap = rack({"a": 4, "b": 2}, [busy, gang("cd-train", "q", 4, gpus=4)])
    result = run_cycle(snap, ["allocate", "consolidate", "reclaim", "preempt"])
    assert all(d.node is None for d in placement_decisions(result, "cd-train"))
    reason = wait_reasons(snap, result, {"far": (4, NO_RESERVATIONS)})["cd-train"]
    assert reason == (
        "no fit in one NVLink clique for the 4 pod(s) of a ComputeDomain needing 16 GPUs: 0/7 nodes are available: "
        "1 node(s) serve no reservations, 2 node(s) in a clique too small for the gang's 16 GPUs (the largest has "
        "16), 4 node(s) in a clique without 16 free GPUs (the freest has 12 free). preemption: 0/7 nodes are "
        "available: 3 Preemption is not helpful for scheduling, 4 No preemption victims found for incoming pod."
    )


def test_the_fullest_clique_that_fits_is_taken_and_other_gangs_are_unbound() -> None:
    # clique a has 2 of its 4 nodes busy: a 2-pod domain gang goes there, leaving clique b whole for a 4-pod one
    busy = gang("busy", "q", 2, gpus=4)
    for i, p in enumerate(busy["pods"]):
        p.update(node=f"a-n{i}", status="Running")
    snap = rack(
        {"a": 4, "b": 4},
        [busy, gang("cd-small", "q", 2, gpus=4), gang("cd-big", "q", 4, gpus=4, created="2025-01-01T01:00:00Z")],
    )
    result = run_cycle(snap, ["allocate"])
    assert sorted(n or "" for n in placement(result, "cd-small").values()) == ["a-n2", "a-n3"]
    assert sorted(n or "" for n in placement(result, "cd-big").values()) == [f"b-n{i}" for i in range(4)]


def test_a_domain_gang_growing_stays_in_the_clique_it_runs_in() -> None:
    job = gang("cd-elastic", "q", 3, gpus=4, min_member=1)
    job["pods"][0].update(node="a-n0", status="Running")
    snap = rack({"a": 2, "b": 4}, [job])
    where = placement(run_cycle(snap, ["allocate"]), "cd-elastic")
    assert sorted(n for n in where.values() if n) == ["a-n0", "a-n1"]  # b has room for both; a for one more


def placement_decisions(result, prefix: str):
    return [d for name, d in result.pods.items() if name.startswith(prefix)]
