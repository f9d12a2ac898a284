"""This node's entry of status.nodes: a Conflict is retried on the fresh object after a jittered backoff."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agent.computedomain import status
from agent.computedomain.model import READY
from agent.kube.errors import Conflict


class Rest:
    """A ComputeDomain whose status writes fail with a Conflict `conflicts` times."""

    def __init__(self, conflicts: int) -> None:
        self.conflicts = conflicts
        self.writes = 0
        self.obj: dict[str, Any] = {
            "metadata": {"namespace": "ns", "name": "d", "uid": "u"},
            "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": "t"}}},
        }

    def get(self, resource: object, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.obj)

    def replace(self, resource: object, obj: dict[str, Any], subresource: str = "") -> dict[str, Any]:
        self.writes += 1
        if self.writes <= self.conflicts:
            raise Conflict(409, "changed")
        self.obj = obj
        return obj


def test_a_conflict_is_retried_after_a_growing_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    waits: list[float] = []
    monkeypatch.setattr(status.time, "sleep", waits.append)
    rest = Rest(conflicts=3)
    written = status.set_entry(
        rest,
        "ns",
        "d",
        node_name="n0",
        ip_address="127.0.0.1",
        clique_id="c.1",
        status=READY,  # type: ignore[arg-type]
    )
    assert written is not None and written.status == READY and [n.name for n in written.nodes] == ["n0"]
    assert rest.writes == 4 and len(waits) == 3
    assert waits[0] >= status.FIRST_RETRY_S and waits[0] < waits[1] < waits[2] <= status.MAX_RETRY_S * 1.5


def test_a_status_that_changes_under_every_write_is_a_conflict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status.time, "sleep", lambda s: None)
    rest = Rest(conflicts=status.ATTEMPTS)
    with pytest.raises(Conflict):
        status.remove_entry(rest, "ns", "d", "n0")  # type: ignore[arg-type]
