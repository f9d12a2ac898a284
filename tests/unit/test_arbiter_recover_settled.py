"""Each cycle's recovery (Committer.recover) looks at a gang again only when the snapshot made it anew: a gang it
found nothing to do for, handed back as the same Gang object (the snapshot keeps a gang none of whose pods and
claims changed), is passed over, so a cycle does not walk every pod of the cluster. Tried: a settled gang handed
back as is, the same gang rebuilt from equal objects, and a reservation to give back whose write fails (looked at
again next cycle, not settled)."""

from __future__ import annotations

from typing import Any

import pytest

from agent.arbiter import commit as commit_module
from agent.arbiter.commit import Committer
from agent.arbiter.world import Gang, Member
from agent.kube.errors import ApiError
from agent.names import ADMITTED_ANNOTATION
from tests.unit.test_arbiter_world import claim, pod


class Rest:
    """The API as the recovery writes to it: every write refused, and counted."""

    def __init__(self) -> None:
        self.writes = 0

    def replace(self, *args: Any, **kwargs: Any) -> Any:
        self.writes += 1
        raise ApiError(500, "the server is away")


def gang(name: str, member: Member) -> Gang:
    return Gang(f"team-a/pod/{name}", "team-a", "team-a", None, 1, {member.key: member})


def running(name: str) -> Member:
    """A pod bound to n0, its claim allocated and reserved for it: nothing to recover."""
    c = claim(f"{name}-gpu", 1, allocated_on="n0", devices=("gpu-0",), reserved_for=name)
    return Member(f"team-a/{name}", pod(name, f"{name}-gpu", gated=False, node_name="n0"), [c], "n0")


def unreserved(name: str) -> Member:
    """An admitted pod, ungated and unbound, whose allocated claim kube-scheduler took it out of."""
    p = pod(name, f"{name}-gpu", gated=False)
    p["metadata"].setdefault("annotations", {})[ADMITTED_ANNOTATION] = "2027-01-15T07:00:00.000Z"
    return Member(f"team-a/{name}", p, [claim(f"{name}-gpu", 1, allocated_on="n0", devices=("gpu-1",))], None)


@pytest.fixture
def looked_at(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The members whose reservations the recovery reads."""
    seen: list[str] = []
    read = commit_module._unreserved

    def counted(member: Member) -> list[Any]:
        seen.append(member.key)
        return read(member)

    monkeypatch.setattr(commit_module, "_unreserved", counted)
    return seen


def test_a_settled_gang_is_passed_over_until_the_snapshot_makes_it_anew(looked_at: list[str]) -> None:
    rest = Rest()
    committer = Committer(rest, "gpu.nvidia.com", dict, ttl_seconds=30, clock=lambda: 0.0)  # type: ignore[arg-type]
    try:
        settled = gang("a", running("a"))
        assert committer.recover([settled]) == ([], [])
        assert looked_at == ["team-a/a"]
        assert committer.recover([settled]) == ([], [])  # the same object: not read again
        assert looked_at == ["team-a/a"]
        assert committer.recover([gang("a", running("a"))]) == ([], [])  # made anew: read again
        assert looked_at == ["team-a/a", "team-a/a"]
        assert rest.writes == 0
    finally:
        committer.close()


def test_a_gang_whose_recovery_failed_is_looked_at_again(looked_at: list[str]) -> None:
    rest = Rest()
    committer = Committer(rest, "gpu.nvidia.com", dict, ttl_seconds=30, clock=lambda: 0.0)  # type: ignore[arg-type]
    try:
        lost = gang("b", unreserved("b"))
        for attempt in (1, 2):  # the write refused: nothing written, tried again the next cycle
            assert committer.recover([lost]) == ([], [])
            assert rest.writes == attempt
        assert looked_at == ["team-a/b", "team-a/b"]
    finally:
        committer.close()
