"""Consumable-capacity shares in the arbiter: a share counts as the part of a GPU it consumed, in the queue and
in fair share, reclaim and preemption; `simulate` snapshots take shares as `gpuMemory`."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import yaml

from agent.allocation.allocator import DeviceRequest
from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.snapshot import SnapshotError, parse_snapshot
from agent.arbiter.world import build_world
from agent.devices.shares import ShareMode
from agent.nvml.source import open_nvml
from agent.objects.read import share_devices
from agent.objects.write import Unsupported, allocation_status, reservation_claim
from agent.slices.build import build_resource_slices
from fakes.scheduler.allocator import allocate
from tests.unit.test_arbiter_support import cycle, doc, job, node, pod, queue
from tests.unit.test_arbiter_world import DRIVER, NOW
from tests.unit.test_arbiter_world import claim as api_claim
from tests.unit.test_arbiter_world import node as api_node
from tests.unit.test_arbiter_world import pod as api_pod
from tests.unit.test_arbiter_world import queue as api_queue
from tests.unit.test_scheduler_shares import DAEMONSET

GI = 1 << 30
H100 = 81559 << 20  # what NVML reports for an H100 80GB HBM3: 79.6 GiB


def shared_claim(name: str, device: str, consumed: dict[str, str], node_name: str = "n0") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "capacity": {"requests": {"memory": consumed["memory"]}},
                        },
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": node_name,
                            "device": device,
                            "shareID": str(uuid.uuid4()),
                            "consumedCapacity": consumed,
                        }
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": name, "uid": f"uid-{name}"}],
        },
    }


MEMORY = ShareMode("memory")


def shared_world(claims: list[dict[str, Any]], mode: ShareMode = MEMORY, pending: list[dict[str, Any]] = ()) -> Any:  # type: ignore[assignment]
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    n, _ = api_node("n0")
    slices = build_resource_slices(inventory, "n0", share_mode=mode)
    pods = [
        api_pod(c["metadata"]["name"], c["metadata"]["name"], gated=False, node_name="n0")
        for c in claims
        if c.get("status")
    ] + list(pending)
    queues = [api_queue("root"), api_queue("team-a", "root", 1)]
    return build_world(
        pods=pods, claims=claims, pod_groups=[], queues=queues, nodes=[n], slices=slices, driver=DRIVER, now=NOW
    )


def test_nine_8gi_shares_of_an_h100_count_as_72_of_79_6_of_a_gpu() -> None:
    consumed = {"memory": "8Gi", "shares": "1"}
    claims = [shared_claim(f"s{i}", "gpu-0", consumed) for i in range(9)]
    held = sum(p.gpu_milli for j in shared_world(claims).snapshot.jobs for p in j.pods)
    assert held == round(72 / 79.647 * 1000) == 904
    claims.append(shared_claim("s9", "gpu-1", consumed))
    w = shared_world(claims)
    assert sum(p.gpu_milli for j in w.snapshot.jobs for p in j.pods) == 1004
    assert w.snapshot.nodes[0].gpus == 8  # shares the queue counts hold no GPU away from the node


def test_a_share_under_a_share_count_is_one_of_n() -> None:
    claims = [shared_claim("s", "gpu-0", {"memory": "0", "shares": "1"})]
    [job_] = shared_world(claims, ShareMode("count", 4)).snapshot.jobs
    assert [p.gpu_milli for p in job_.pods] == [250]


def test_a_pending_share_asks_the_node_for_the_fraction_of_a_gpu_it_will_consume() -> None:
    claim = shared_claim("s", "gpu-0", {"memory": "8Gi"})
    del claim["status"]
    with open_nvml("fake:dgx-h100") as nvml:
        slices = build_resource_slices(nvml.discover(), "n0", share_mode=MEMORY)
    devices = share_devices(slices, DRIVER)
    # 8Gi of an H100's 81559Mi, rounded up as the node counts allocated shares: 101 milli-GPUs
    assert reservation_claim(claim, devices.values()).requests == (DeviceRequest("gpu", gpu_milli=101),)
    with pytest.raises(Unsupported, match="no GPU published for sharing takes a share of memory=8Gi"):
        reservation_claim(claim)  # no device published for sharing
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "81Gi"
    with pytest.raises(Unsupported, match="memory=81Gi"):  # more than the GPU has: upstream's max
        reservation_claim(claim, devices.values())


def test_the_commit_writes_a_share_as_kube_scheduler_does() -> None:
    claim = shared_claim("s", "gpu-0", {"memory": "8Gi"})
    del claim["status"]
    claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "7000Mi"
    with open_nvml("fake:dgx-h100") as nvml:
        slices = build_resource_slices(nvml.discover(), "n0", share_mode=MEMORY)
    classes = [d for d in yaml.safe_load_all((DAEMONSET / "base" / "deviceclasses.yaml").read_text()) if d]
    ids = iter(["0b6f5c1e-2d4a-4c8e-9f10-3a5b7c9d1e2f"])
    ours = allocation_status(
        claim,
        "n0",
        DRIVER,
        {"gpu": ["gpu-3"]},
        {str(c["metadata"]["name"]): c for c in classes},
        shareable=share_devices(slices, DRIVER),
        share_id=lambda: next(ids),
    )
    # kube-scheduler's choice, given only gpu-3
    only = [
        {"spec": {**s["spec"], "devices": [d for d in s["spec"]["devices"] if d["name"] == "gpu-3"]}} for s in slices
    ]
    theirs = allocate(claim, only, classes)
    [mine], [real] = ours["devices"]["results"], theirs["devices"]["results"]
    assert mine["shareID"] == "0b6f5c1e-2d4a-4c8e-9f10-3a5b7c9d1e2f"
    assert {k: v for k, v in mine.items() if k != "shareID"} == {k: v for k, v in real.items() if k != "shareID"}
    assert mine["consumedCapacity"] == {"memory": "7000Mi", "shares": "1"}
    assert ours["nodeSelector"] == theirs["nodeSelector"]
    with pytest.raises(Unsupported, match="gpu-3 of node n0 cannot take a share"):  # not published for sharing
        allocation_status(claim, "n0", DRIVER, {"gpu": ["gpu-3"]}, {}, shareable={}, share_id=lambda: "x")


def test_pending_shares_are_planned_as_fractions_onto_one_gpu() -> None:
    pending = []
    claims = []
    for i in range(9):
        c = shared_claim(f"p{i}", "gpu-0", {"memory": "8Gi"})
        del c["status"]
        claims.append(c)
        pending.append(api_pod(f"p{i}", f"p{i}"))
    world_ = shared_world(claims, pending=pending)
    milli = [p.gpu_milli for j in world_.snapshot.jobs for p in j.pods]
    assert len(milli) == 9 and set(milli) == {101} and not world_.waiting
    result = run_cycle(world_.snapshot, ["allocate"])
    assert {result.pods[f"team-a/p{i}"].action for i in range(9)} == {"bind"}


def share(name: str, node_name: str | None = None, memory: float = 8 * GI) -> dict[str, Any]:
    p = pod(name, node=node_name, gpuMemory=memory)
    del p["gpus"]
    return p


def test_shared_claims_of_two_queues_meet_their_quotas() -> None:
    # one H100 shared half and half: team a runs nine 8Gi inference pods (0.909 of the GPU), team b arrives with
    # five. Reclaim takes a's shares down to its half, b gets what fits in its half, and no GPU is overfilled.
    document = doc(
        [node("n", 1, gpuMemory=H100)],
        [queue("a", quota=0.5), queue("b", quota=0.5)],
        [
            job("ja", "a", [share(f"a{i}", "n") for i in range(9)], min_member=1),
            job("jb", "b", [share(f"b{i}") for i in range(5)], min_member=1, created="2025-01-01T01:00:00Z"),
        ],
    )
    result = cycle(document)
    assert result.fair_share["a"][0] == result.fair_share["b"][0] == 500
    kept = [n for n, d in result.pods.items() if n.startswith("a") and d.outcome == "running"]
    evicted = [n for n, d in result.pods.items() if d.action == "evict"]
    placed = [n for n, d in result.pods.items() if n.startswith("b") and d.action == "pipeline"]
    assert (len(kept), len(evicted), len(placed)) == (5, 4, 4)
    assert result.allocated["a"][0] == 505 and result.allocated["b"][0] == 404
    assert result.allocated["a"][0] + result.allocated["b"][0] <= 1000


def test_nine_shares_fit_a_gpu_in_the_simulator_and_a_tenth_does_not() -> None:
    document = doc(
        [node("n", 1, gpuMemory=H100)], [queue("q")], [job("j", "q", [share(f"s{i}") for i in range(10)], min_member=1)]
    )
    result = cycle(document, "allocate")
    assert sorted(d.outcome for d in result.pods.values()).count("running") == 9


@pytest.mark.parametrize(
    ("pod_extra", "message"),
    [
        ({"gpus": 0.5}, "both gpus and gpuMemory"),
        ({"gpuMemory": 90 * GI}, "at most a GPU's"),
    ],
)
def test_bad_shares_are_refused_with_a_reason(pod_extra: dict[str, Any], message: str) -> None:
    p = share("s")
    p.update(pod_extra)
    with pytest.raises(SnapshotError, match=message):
        parse_snapshot(doc([node("n", 1, gpuMemory=H100)], [queue("q")], [job("j", "q", [p])]))


def test_a_share_needs_a_node_that_says_its_gpu_memory() -> None:
    with pytest.raises(SnapshotError, match="says its GPUs' gpuMemory"):
        parse_snapshot(doc([node("n", 1)], [queue("q")], [job("j", "q", [share("s")])]))


def test_running_shares_sit_on_the_gpu_they_use_so_the_cycle_sees_the_node_as_it_is() -> None:
    # gpu-0 and gpu-1 each hold a 48Gi and a 31Gi share, so six GPUs of the eight are free. Seated anywhere, the
    # shares would be packed onto three GPUs (the second 48Gi one fits beside neither 31Gi pair) and a gang
    # of six whole GPUs would find five.
    claims = [
        shared_claim("a-small", "gpu-0", {"memory": "31Gi"}),
        shared_claim("b-small", "gpu-1", {"memory": "31Gi"}),
        shared_claim("c-big", "gpu-0", {"memory": "48Gi"}),
        shared_claim("d-big", "gpu-1", {"memory": "48Gi"}),
    ]
    six = api_claim("six", 6)
    world_ = shared_world([*claims, six], pending=[api_pod("train", "six")])
    seats = {p.name.split("/")[-1]: p.gpu_index for j in world_.snapshot.jobs for p in j.pods if p.fractional}
    assert seats == {"a-small": 0, "b-small": 1, "c-big": 0, "d-big": 1}
    result = run_cycle(world_.snapshot, ["allocate"])
    assert result.pods["team-a/train"].action == "bind"


def test_shares_that_overfill_a_gpu_are_clamped_and_the_cycle_goes_on() -> None:
    # a stale or wrong allocation: 90Gi of shares on a 79.6 GiB GPU
    claims = [shared_claim(f"s{i}", "gpu-0", {"memory": "30Gi"}) for i in range(3)]
    world_ = shared_world(claims)
    assert sum(p.gpu_milli for j in world_.snapshot.jobs for p in j.pods) == 1000
    run_cycle(world_.snapshot, ["allocate", "reclaim", "preempt"])
