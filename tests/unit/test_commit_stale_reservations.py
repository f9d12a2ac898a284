"""A gang's commit frees the reservations an arbiter killed mid-commit left behind, and only then: when a node
answers that a member does not fit (NoFit), the commit releases the gang's reservations on its nodes and tries
once more. The decision was made by finding "does not fit" in the refusal's words, so an unreachable node whose
error said those words was taken for a full one, and a node's words alone decided a release (issue 34, item 2);
it is now the refusal's kind (agent.reservation.protocol.Refused)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from agent.allocation.allocator import Claim, NoFit
from agent.allocation.capacity import CapacitySummary
from agent.arbiter.commit import Committer
from agent.arbiter.world import Member
from agent.reservation.protocol import NodeBusy, NodeUnavailable, Reservation, reserve_each
from tests.unit.test_arbiter_world import claim, pod

NODE = "n0"


class Node:
    """A node's client that refuses every Reserve with `error`, and counts the calls."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.reserves = 0
        self.gang_releases: list[str] = []

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        self.reserves += 1
        raise self.error

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        return reserve_each(self.reserve, self.release, gang_id, members, ttl_seconds)

    def confirm(self, reservation_id: str) -> Reservation:
        raise AssertionError("nothing was reserved")

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        raise AssertionError("nothing was reserved")

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        self.gang_releases.append(gang_id)
        return 0

    def capacity(self) -> CapacitySummary:
        raise AssertionError("not asked")


def commit(node: Node) -> Any:
    committer = Committer(
        None,
        "gpu.nvidia.com",
        lambda: {NODE: node},  # type: ignore[arg-type]  # no write made
        ttl_seconds=30,
        clock=lambda: 0.0,
    )
    try:
        member = Member("team-a/p", pod("p", "c"), [claim("c", 2)])
        return committer.commit("team-a/pod/p", [(member, NODE)], {})
    finally:
        committer.close()


def test_a_member_that_does_not_fit_frees_the_gangs_stale_reservations_and_tries_again() -> None:
    node = Node(NoFit("2 GPUs wanted, 0 free"))
    outcome = commit(node)
    assert node.gang_releases == ["team-a/pod/p"] and node.reserves == 2
    assert not outcome.committed and "does not fit on n0: 2 GPUs wanted, 0 free" in outcome.reason


@pytest.mark.parametrize(
    "error",
    [
        NodeUnavailable("UNAVAILABLE: the member does not fit in the send window"),
        NodeBusy("node busy: the Reserve does not fit in the queue"),
    ],
    ids=["unreachable", "busy"],
)
def test_a_node_that_did_not_answer_is_not_taken_for_a_full_one(error: Exception) -> None:
    # tried: the refusal's words say "does not fit", the node did not say the member does not fit
    node = Node(error)
    outcome = commit(node)
    assert node.gang_releases == [] and node.reserves == 1
    assert not outcome.committed and outcome.reason.startswith(f"node n0: {type(error).__name__}: ")
