"""A commit books the CPU of each step to the thread that spent it (Committer.cpu_timings, which the arbiter logs
and `make bench` prints a pod): the commit's own thread for its steps, and the I/O threads' writes as steps of
their own, so that the two add up without counting a write twice. Tried: a gang of two, whose writes go to the
I/O threads, and a gang of one, whose writes its commit's thread makes itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from agent.allocation.allocator import Claim, Fit
from agent.allocation.capacity import CapacitySummary
from agent.arbiter.commit import Committer
from agent.arbiter.world import Member
from agent.jsontypes import Json
from agent.names import DELETE_PROTECTION
from agent.reservation.protocol import Reservation
from tests.unit.test_arbiter_world import claim, pod

NODE = "n0"
BURN_S = 0.01  # CPU each write spends, so that whose thread it was is plain


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Api:
    """What the commit writes through: every write answered as written, after BURN_S of CPU."""

    def __init__(self) -> None:
        self.writes = 0
        self._lock = threading.Lock()  # written from the I/O threads at once

    def replace(self, resource: Any, body: Json, subresource: str = "") -> Json:
        _burn(BURN_S)
        with self._lock:
            self.writes += 1
            version = str(self.writes)
        return {**body, "metadata": {**body["metadata"], "resourceVersion": version}}


class Node:
    """A node that reserves one GPU a member, gpu-0 upward, and confirms whatever it reserved."""

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        return [
            Reservation(f"r{i}", gang_id, member, Fit({"gpus": (f"gpu-{i}",)}), 1e12)
            for i, (member, _) in enumerate(members)
        ]

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        return []

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        return 0

    def capacity(self) -> CapacitySummary:
        raise AssertionError("not asked")


def _protected(name: str) -> Json:
    """A claim made with its finalizer (the arbiter's claim-protection policy): one write, its status."""
    out = claim(name)
    out["metadata"]["finalizers"] = [DELETE_PROTECTION]
    return out


def _commit(names: Sequence[str]) -> tuple[Committer, Api]:
    api = Api()
    committer = Committer(
        api,  # type: ignore[arg-type]  # replace() is all a commit of gated pods writes through
        "gpu.nvidia.com",
        lambda: {NODE: Node()},  # type: ignore[dict-item]
        ttl_seconds=30,
        clock=lambda: 0.0,
    )
    try:
        members = [(Member(f"team-a/{n}", pod(n, f"c-{n}"), [_protected(f"c-{n}")]), NODE) for n in names]
        outcome = committer.commit("team-a/job", members, {})
    finally:
        committer.close()
    assert outcome.committed, outcome.reason
    return committer, api


def test_the_io_threads_writes_are_booked_apart_from_the_commits_own_steps() -> None:
    committer, api = _commit(["p0", "p1"])
    cpu = committer.cpu_timings
    assert api.writes == 4  # two claims' statuses, two pods ungated
    # each write's CPU on the I/O threads' steps, and not again in the step of the thread that waited for them
    assert cpu["write claims (I/O threads)"] >= 2 * BURN_S * 0.9
    assert cpu["ungate (I/O threads)"] >= 2 * BURN_S * 0.9
    assert cpu["write claims"] < BURN_S and cpu["ungate"] < BURN_S
    assert {"reserve", "confirm"} <= cpu.keys()
    assert committer.timings.keys() == cpu.keys()  # the wall time of the same steps


def test_a_gang_of_one_books_its_writes_to_its_own_thread() -> None:
    committer, api = _commit(["p0"])
    cpu = committer.cpu_timings
    assert api.writes == 2
    assert not any(step.endswith("(I/O threads)") for step in cpu)
    assert cpu["write claims"] >= BURN_S * 0.9 and cpu["ungate"] >= BURN_S * 0.9
