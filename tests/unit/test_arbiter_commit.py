"""The simulator's commit step: gangs go through Reserve/Confirm/Release on in-process node allocators."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest

from agent.allocation.allocator import Claim, DeviceRequest
from agent.allocation.catalog import NodeUsage, candidates
from agent.allocation.selectors import CelSelectors
from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.model import NodeSpec, Snapshot
from agent.arbiter.core.snapshot import parse_snapshot
from agent.reservation.protocol import InProcessClient, NodeAllocatorService, Reservation, Unauthenticated
from agent.simulation.nodes import PinningSelectors, ReservationCommit, node_inventory
from agent.simulation.rounds import simulate
from tests.unit.test_arbiter_support import doc, gang, job, node, pod, queue

TOKEN = "t0ken"
ACTIONS = ["allocate", "consolidate", "reclaim", "preempt"]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def committer(snapshot: Snapshot, clock: Clock | None = None, **kw: Any) -> ReservationCommit:
    return ReservationCommit(snapshot.nodes, clock or Clock(), TOKEN, ttl_seconds=10, **kw)


def live(c: ReservationCommit, node_name: str) -> list[Reservation]:
    return c.node(node_name).book.live()


def test_a_gang_across_nodes_is_reserved_confirmed_and_bound() -> None:
    snap = parse_snapshot(doc([node("a", 2), node("b", 2)], [queue("q")], [gang("g", "q", 4)]))
    c = committer(snap)
    result = c(run_cycle(snap, ACTIONS))
    assert {d.action for d in result.pods.values()} == {"bind"}
    assert c.stats.committed == 1 and c.stats.refused == 0
    assert all(r.confirmed for n in ("a", "b") for r in live(c, n))
    assert sorted(r.member for n in ("a", "b") for r in live(c, n)) == ["g-0", "g-1", "g-2", "g-3"]


def test_one_node_refusing_binds_no_member_and_releases_every_reservation() -> None:
    # node b's allocator sees a GPU unhealthy that the arbiter still counts: b can take one member, not two
    snap = parse_snapshot(doc([node("a", 2), node("b", 2)], [queue("q")], [gang("g", "q", 4)]))
    c = committer(snap)
    c.node("b").mark_unhealthy(1)
    result = c(run_cycle(snap, ACTIONS))
    assert all(
        result.pods[f"g-{i}"] == dataclasses.replace(result.pods[f"g-{i}"], outcome="pending", node=None, action="keep")
        for i in range(4)
    )
    assert c.stats.refused == 1 and c.stats.committed == 0
    assert set(c.stats.refused_pods) == {"g-0", "g-1", "g-2", "g-3"} and "b" in c.stats.refused_pods["g-0"]
    assert live(c, "a") == [] and live(c, "b") == []
    assert result.next.jobs[0].pods[0].status == "Pending" and result.next.jobs[0].pods[0].node is None


def test_a_wrong_or_missing_token_is_refused() -> None:
    snap = parse_snapshot(doc([node("a", 2)], [queue("q")], [gang("g", "q", 1)]))
    for bad in ("not-the-token", None):
        c = committer(snap, connect=lambda service, _token, bad=bad: InProcessClient(service, bad))
        result = c(run_cycle(snap, ACTIONS))
        assert result.pods["g-0"].action == "keep" and c.stats.refused == 1
        assert "Unauthenticated" in c.stats.refused_pods["g-0"]
        assert live(c, "a") == []
    service = committer(snap).node("a").service
    claim = Claim((DeviceRequest("gpus"),))
    with pytest.raises(Unauthenticated):
        service.reserve(None, "g", "g-0", claim, 10)
    with pytest.raises(ValueError, match="anonymous"):
        NodeAllocatorService(service.book, "")


class Unreachable(InProcessClient):
    """The node stops answering after its reservation is made: the confirm and the release are lost."""

    def confirm(self, reservation_id: str) -> Reservation:
        raise ConnectionResetError("node unreachable")

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        raise ConnectionResetError("node unreachable")

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        raise ConnectionResetError("node unreachable")


def test_a_reservation_left_behind_expires_and_frees_its_devices() -> None:
    snap = parse_snapshot(doc([node("a", 2)], [queue("q")], [gang("g", "q", 2)]))
    clock = Clock()
    c = committer(snap, clock, connect=Unreachable)
    assert c(run_cycle(snap, ACTIONS)).pods["g-0"].action == "keep" and c.stats.refused == 1
    book = c.node("a").book
    assert len(book.live()) == 2 and book.capacity().free_gpu_milli == 0  # held until the TTL
    clock.now += 10.5
    assert book.live() == [] and book.capacity().free_gpu_milli == 2000


def test_evicted_pods_release_their_reservations() -> None:
    low = gang("low", "q", 2, priority=50)
    snap = parse_snapshot(doc([node("a", 2)], [queue("q")], [low]))
    c = committer(snap)
    first = c(run_cycle(snap, ACTIONS))
    assert len(live(c, "a")) == 2
    high = parse_snapshot(doc([node("a", 2)], [queue("q")], [gang("high", "q", 2, priority=75)]))
    second = dataclasses.replace(first.next, jobs=first.next.jobs + high.jobs)
    result = c(run_cycle(second, ACTIONS))
    assert {result.pods[p].action for p in ("low-0", "low-1")} == {"evict"}
    assert c.stats.released == 2 and live(c, "a") == []
    third = c(run_cycle(result.next, ACTIONS))
    assert {third.pods[p].action for p in ("high-0", "high-1")} == {"bind"}
    assert sorted(r.member for r in live(c, "a")) == ["high-0", "high-1"]


def test_fractional_pods_report_the_gpu_their_node_reserved() -> None:
    pods = [pod(f"f{i}", 0.25) for i in range(6)]
    snap = parse_snapshot(doc([node("a", 4)], [queue("q")], [job("j", "q", pods)]))
    c = committer(snap)
    result = c(run_cycle(snap, ACTIONS))
    reserved = {r.member: next(iter(r.fit.shared_milli)) for r in live(c, "a")}
    assert len(reserved) == 6
    assert all(f"gpu-{result.pods[p].gpu_index}" == dev for p, dev in reserved.items())


def test_when_the_arbiters_gpu_is_not_free_the_nodes_choice_is_reported_and_kept() -> None:
    snap = parse_snapshot(doc([node("a", 2)], [queue("q")], [gang("f", "q", 1, gpus=0.5)]))
    arbiter_only = run_cycle(snap, ACTIONS)
    chosen = arbiter_only.pods["f-0"].gpu_index
    assert chosen is not None
    c = committer(snap)
    c.node("a").mark_unhealthy(chosen)
    sim = simulate(snap, ACTIONS, 2, Clock(), c)
    assert c.stats.relocated == 1 and c.stats.refused == 0
    assert sim.last.pods["f-0"].outcome == "running" and sim.last.pods["f-0"].gpu_index == 1 - chosen
    assert sim.last.before.jobs[0].pods[0].gpu_index == 1 - chosen  # round 2 started from the node's choice


def test_consistent_views_never_refuse_and_change_no_decision_of_a_first_round() -> None:
    nodes = [node(f"n{i}", 8, nvlinkDomains=[[0, 1, 2, 3], [4, 5, 6, 7]]) for i in range(4)]
    jobs = [gang(f"run{i}", "a", 3, node=f"n{i}") for i in range(4)]
    jobs += [job("mix", "b", [pod(f"m{i}", g) for i, g in enumerate([0.5, 0.25, 2, 1, 0.5, 0, 4])], min_member=3)]
    jobs += [gang(f"g{i}", "b", 1 + i % 3, gpus=0.5 if i % 2 else 1) for i in range(6)]
    snap = parse_snapshot(doc(nodes, [queue("a", quota=8), queue("b", quota=24)], jobs))
    plain = simulate(snap, ACTIONS, 1, Clock())
    c = committer(snap)
    committed = simulate(snap, ACTIONS, 1, Clock(), c)
    assert committed.last.pods == plain.last.pods
    assert c.stats.refused == 0 and c.stats.relocated == 0 and c.stats.committed >= 7


def test_pinned_selectors_mean_what_cel_means() -> None:
    inv = node_inventory(NodeSpec("n", 4, 1000, 1000, "H100", {}, ((0, 1), (2, 3))))
    pins = PinningSelectors()
    expression = pins.pin((1, 3))
    cel = CelSelectors()
    for cand in candidates(inv, NodeUsage()):
        assert pins.matches(expression, cand.env) == cel.matches(expression, cand.env)
    assert [c.name for c in candidates(inv, NodeUsage()) if pins.matches(expression, c.env)] == ["gpu-1", "gpu-3"]


def test_synthetic_inventory_follows_the_snapshot_node() -> None:
    inv = node_inventory(NodeSpec("n", 4, 1000, 1000, "H100", {}, ((0, 1, 2),)))
    assert [g.product_name for g in inv.gpus] == ["H100"] * 4
    assert sorted(d.gpu_minors for d in inv.nvlink_domains) == [(0, 1, 2), (3,)]


def test_a_bad_ttl_is_refused() -> None:
    snap = parse_snapshot(doc([node("a", 2)], [queue("q")], []))
    with pytest.raises(ValueError, match="ttl_seconds must be positive"):
        ReservationCommit(snap.nodes, Clock(), TOKEN, ttl_seconds=0)
