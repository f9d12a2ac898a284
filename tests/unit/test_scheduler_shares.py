"""The fake kube-scheduler allocates consumable capacity as upstream's structured allocator does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.devices.shares import ShareMode
from agent.nvml.source import open_nvml
from agent.slices.build import build_resource_slices
from fakes.scheduler import Unsatisfiable, allocate

DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"


@pytest.fixture(scope="module")
def shared_dgx() -> tuple[list[dict], list[dict]]:
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    classes = list(yaml.safe_load_all((DAEMONSET / "base" / "deviceclasses.yaml").read_text()))
    return build_resource_slices(inventory, "dgx", share_mode=ShareMode("memory")), classes


def claim(uid: str, memory: str | None = "8Gi", count: int = 1, requests: int = 1) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com", "count": count}
    if memory is not None:
        exactly["capacity"] = {"requests": {"memory": memory}}
    return {
        "metadata": {"name": uid, "namespace": "default", "uid": uid},
        "spec": {"devices": {"requests": [{"name": f"r{i}", "exactly": exactly} for i in range(requests)]}},
    }


def allocate_in_turn(claims: list[dict[str, Any]], slices: list[dict], classes: list[dict]) -> list[dict[str, Any]]:
    done: list[dict[str, Any]] = []
    for c in claims:
        c["status"] = {"allocation": allocate(c, slices, classes, done)}
        done.append(c)
    return done


def results(c: dict[str, Any]) -> list[dict[str, Any]]:
    return list(c["status"]["allocation"]["devices"]["results"])


def test_nine_8gi_claims_share_one_h100_and_the_tenth_takes_another(shared_dgx: Any) -> None:
    slices, classes = shared_dgx
    done = allocate_in_turn([claim(f"c{i}") for i in range(10)], slices, classes)
    devices = [results(c)[0]["device"] for c in done]
    assert devices[:9] == ["gpu-0"] * 9
    assert devices[9] == "gpu-1"
    share_ids = {results(c)[0]["shareID"] for c in done}
    assert len(share_ids) == 10
    assert all(results(c)[0]["consumedCapacity"] == {"memory": "8Gi", "shares": "1"} for c in done)


def test_a_request_is_recorded_as_what_the_policy_rounds_it_to(shared_dgx: Any) -> None:
    slices, classes = shared_dgx
    [done] = allocate_in_turn([claim("c", memory="1000Ki")], slices, classes)
    assert results(done)[0]["consumedCapacity"]["memory"] == "1Mi"


def test_a_claim_naming_no_memory_takes_the_whole_gpu(shared_dgx: Any) -> None:
    slices, classes = shared_dgx
    done = allocate_in_turn([claim("whole", memory=None), claim("small")], slices, classes)
    assert results(done[0])[0]["consumedCapacity"]["memory"] == "81559Mi"
    assert results(done[1])[0]["device"] != results(done[0])[0]["device"]


def test_one_claim_may_take_two_shares_of_one_gpu(shared_dgx: Any) -> None:
    slices, classes = shared_dgx
    [done] = allocate_in_turn([claim("two", memory="30Gi", requests=2)], slices, classes)
    assert [r["device"] for r in results(done)] == ["gpu-0", "gpu-0"]
    assert results(done)[0]["shareID"] != results(done)[1]["shareID"]


def test_more_memory_than_a_gpu_has_is_unsatisfiable(shared_dgx: Any) -> None:
    slices, classes = shared_dgx
    with pytest.raises(Unsatisfiable, match="no matching device"):
        allocate(claim("big", memory="80Gi"), slices, classes)


def test_full_gpus_are_unsatisfiable_for_shares_until_one_is_released(shared_dgx: Any) -> None:
    slices, classes = shared_dgx
    done = allocate_in_turn([claim(f"w{i}", memory=None) for i in range(8)], slices, classes)
    with pytest.raises(Unsatisfiable) as err:
        allocate(claim("late"), slices, classes, done)
    assert err.value.in_use


def test_exclusive_gpus_check_capacity_requests_too() -> None:
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    classes = list(yaml.safe_load_all((DAEMONSET / "base" / "deviceclasses.yaml").read_text()))
    slices = build_resource_slices(inventory, "dgx")
    result = results(allocate_in_turn([claim("c")], slices, classes)[0])[0]
    assert "shareID" not in result and "consumedCapacity" not in result
    with pytest.raises(Unsatisfiable):
        allocate(claim("big", memory="90Gi"), slices, classes)
