"""Prioritized lists (`firstAvailable`) in the arbiter, as kube-scheduler's structured allocator takes them: the
subrequests in order, the first that fits wins, and the allocation names it `request/subrequest`. The arbiter
used to plan, reserve and allocate the first entry alone, so a claim `[{count: 9}, {count: 1}]` on 8-GPU nodes
waited forever (issue 33, item 2)."""

from __future__ import annotations

from typing import Any

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.waiting import wait_reasons
from agent.objects.read import choices
from agent.objects.write import allocation_status, reservation_claim
from tests.unit.test_arbiter_world import DRIVER, claim, pod, world


def first_available(
    name: str, *counts: tuple[str, int], allocated_on: str | None = None, devices: tuple[str, ...] = ()
) -> dict[str, Any]:
    c = claim(name, 1, allocated_on, devices, f"holder-{name}" if allocated_on else None)
    c["spec"]["devices"]["requests"] = [
        {
            "name": "gpus",
            "firstAvailable": [
                {"name": sub, "deviceClassName": "gpu.nvidia.com", "count": count} for sub, count in counts
            ],
        }
    ]
    return c


def test_subrequests_are_tried_depth_first_the_first_request_changing_last() -> None:
    c = claim("c")
    c["spec"]["devices"]["requests"] = [
        {
            "name": "a",
            "firstAvailable": [
                {"name": "x", "deviceClassName": "gpu.nvidia.com"},
                {"name": "y", "deviceClassName": "gpu.nvidia.com"},
            ],
        },
        {"name": "b", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
        {"name": "c", "firstAvailable": [{"name": sub, "deviceClassName": "gpu.nvidia.com"} for sub in "pqr"]},
    ]
    assert list(choices(c)) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (1, 0, 0), (1, 0, 1), (1, 0, 2)]


def test_a_first_entry_no_node_can_hold_falls_back_to_the_next() -> None:
    w = world([pod("p", "c")], [first_available("c", ("nine", 9), ("one", 1))])
    (job,) = w.snapshot.jobs
    assert [p.gpu_milli for p in job.pods] == [1000]  # was 9000: "more than the whole cluster has"
    member = w.members["team-a/p"]
    assert member.choices == {"c": (1,)}
    asked = reservation_claim(member.claims[0], (), member.choices["c"])
    assert [(r.name, r.count) for r in asked.requests] == [("gpus/one", 1)]
    result = run_cycle(w.snapshot)
    assert result.pods["team-a/p"].outcome == "running" and wait_reasons(w.snapshot, result) == {}


def test_the_first_entry_that_fits_a_node_now_wins_else_the_first_that_ever_fits() -> None:
    busy = [first_available(f"h{i}", ("one", 1), allocated_on=f"n{i}", devices=("gpu-0",)) for i in range(2)]
    wants = first_available("c", ("eight", 8), ("one", 1))
    # each node has 7 free: 8 fits none now, 1 does
    assert world([pod("p", "c")], [wants, *busy]).members["team-a/p"].choices == {"c": (1,)}
    # one node empty: 8 fits there
    assert world([pod("p", "c")], [wants, busy[0]]).members["team-a/p"].choices == {"c": (0,)}
    # nothing free anywhere: the first entry that fits an empty node, which the gang waits or reclaims for
    full = [
        first_available(f"f{i}", ("eight", 8), allocated_on=f"n{i}", devices=tuple(f"gpu-{d}" for d in range(8)))
        for i in range(2)
    ]
    assert world([pod("p", "c")], [wants, *full]).members["team-a/p"].choices == {"c": (0,)}


def test_the_allocation_names_the_subrequest_and_its_class_config() -> None:
    c = first_available("c", ("nine", 9), ("one", 1))
    classes = {"gpu.nvidia.com": {"spec": {"config": [{"opaque": {"driver": DRIVER, "parameters": {}}}]}}}
    allocation = allocation_status(c, "n0", DRIVER, {"gpus/one": ["gpu-3"]}, classes, choice=(1,))
    assert allocation["devices"]["results"] == [
        {"request": "gpus/one", "driver": DRIVER, "pool": "n0", "device": "gpu-3"}
    ]
    # the claim's one request: the class's config applies to all of it, written without requests as upstream
    assert allocation["devices"]["config"] == [{"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {}}}]
