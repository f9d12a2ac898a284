"""The fake kube-scheduler allocator: selectors, constraints with backtracking, taken devices, configs, nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.nvml.source import open_nvml
from agent.slices.build import build_resource_slices
from fakes.scheduler import Unsatisfiable, allocate

DRIVER = "gpu.nvidia.com"
DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"
GPU_CLASS = {
    "metadata": {"name": "gpu.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].type == 'gpu'"}}]},
}
MIG_CLASS = {
    "metadata": {"name": "mig.nvidia.com"},
    "spec": {"selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].type == 'mig'"}}]},
}


def device(name: str, memory: str = "80Gi", domain: str = "nvl-a", kind: str = "gpu") -> dict:
    return {
        "name": name,
        "attributes": {"type": {"string": kind}, "nvlinkDomain": {"string": domain}},
        "capacity": {"memory": {"value": memory}},
    }


def pool(node: str, *devices: dict, generation: int = 1) -> dict:
    return {
        "metadata": {"name": f"{node}-{generation}"},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": list(devices),
        },
    }


def claim(*requests: dict, constraints: list | None = None, config: list | None = None, uid: str = "u1") -> dict:
    devices: dict = {"requests": list(requests)}
    if constraints:
        devices["constraints"] = constraints
    if config:
        devices["config"] = config
    return {"metadata": {"name": "c", "namespace": "default", "uid": uid}, "spec": {"devices": devices}}


def request(name: str = "gpu", count: int = 1, selectors: tuple[str, ...] = (), cls: str = "gpu.nvidia.com") -> dict:
    exactly: dict = {"deviceClassName": cls, "count": count}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def allocated(uid: str, *devices: str, node: str = "node-a") -> dict:
    results = [{"request": "gpu", "driver": DRIVER, "pool": node, "device": d} for d in devices]
    return {"metadata": {"uid": uid}, "status": {"allocation": {"devices": {"results": results}}}}


def chosen(allocation: dict) -> list[str]:
    return [r["device"] for r in allocation["devices"]["results"]]


def test_class_and_request_selectors_both_filter() -> None:
    slices = [pool("node-a", device("mig-0", "10Gi", kind="mig"), device("gpu-0", "24Gi"), device("gpu-1", "80Gi"))]
    big = request(selectors=("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",))
    allocation = allocate(claim(big), slices, [GPU_CLASS, MIG_CLASS])
    assert chosen(allocation) == ["gpu-1"]
    assert allocation["devices"]["results"][0] == {
        "request": "gpu",
        "driver": DRIVER,
        "pool": "node-a",
        "device": "gpu-1",
    }


def test_node_selector_names_the_slices_node() -> None:
    allocation = allocate(claim(request()), [pool("node-b", device("gpu-0"))], [GPU_CLASS])
    assert allocation["nodeSelector"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-b"]}]}]
    }


def test_match_attribute_backtracks_past_a_dead_end() -> None:
    # The first device in order is alone in its NVLink domain: picking it first leaves no partner.
    slices = [pool("node-a", device("gpu-0", domain="x"), device("gpu-1", domain="y"), device("gpu-2", domain="y"))]
    constraint = [{"requests": ["gpus"], "matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]
    allocation = allocate(claim(request("gpus", count=2), constraints=constraint), slices, [GPU_CLASS])
    assert chosen(allocation) == ["gpu-1", "gpu-2"]


def test_match_attribute_across_requests() -> None:
    # Request "a" would take the lone gpu-0 first; the constraint spans both requests, so it must move on.
    slices = [pool("node-a", device("gpu-0", domain="x"), *(device(f"gpu-{i}", domain="y") for i in (1, 2, 3)))]
    constraint = [{"matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]  # no requests: applies to all of them
    allocation = allocate(claim(request("a"), request("b", count=2), constraints=constraint), slices, [GPU_CLASS])
    pairs = [(r["request"], r["device"]) for r in allocation["devices"]["results"]]
    assert pairs == [("a", "gpu-1"), ("b", "gpu-2"), ("b", "gpu-3")]


def test_match_attribute_unsatisfiable_says_so() -> None:
    # Tried: two GPUs from one NVLink domain where every domain has one.
    slices = [pool("node-a", device("gpu-0", domain="x"), device("gpu-1", domain="y"))]
    constraint = [{"matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]
    with pytest.raises(Unsatisfiable, match="constraints.*nvlinkDomain"):
        allocate(claim(request("gpus", count=2), constraints=constraint), slices, [GPU_CLASS])


def test_devices_without_the_constrained_attribute_are_not_chosen() -> None:
    lone = device("gpu-0")
    del lone["attributes"]["nvlinkDomain"]
    slices = [pool("node-a", lone, device("gpu-1"))]
    constraint = [{"matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]
    assert chosen(allocate(claim(request(), constraints=constraint), slices, [GPU_CLASS])) == ["gpu-1"]


def test_devices_allocated_to_other_claims_are_skipped() -> None:
    slices = [pool("node-a", device("gpu-0"), device("gpu-1"))]
    others = [allocated("other", "gpu-0")]
    assert chosen(allocate(claim(request()), slices, [GPU_CLASS], others)) == ["gpu-1"]


def test_the_claims_own_old_allocation_does_not_block_it() -> None:
    slices = [pool("node-a", device("gpu-0"))]
    assert chosen(allocate(claim(request(), uid="me"), slices, [GPU_CLASS], [allocated("me", "gpu-0")])) == ["gpu-0"]


def test_all_devices_taken_is_unsatisfiable_and_worth_retrying() -> None:
    # Tried: one GPU wanted, the only GPU held by another claim.
    slices = [pool("node-a", device("gpu-0"))]
    with pytest.raises(Unsatisfiable, match="request 'gpu'.*no matching device") as failure:
        allocate(claim(request()), slices, [GPU_CLASS], [allocated("other", "gpu-0")])
    assert failure.value.in_use


def test_no_matching_device_anywhere_is_not_worth_retrying() -> None:
    # Tried: a MIG slice on a node with only whole GPUs.
    with pytest.raises(Unsatisfiable, match="no matching device on node node-a") as failure:
        allocate(claim(request(cls="mig.nvidia.com")), [pool("node-a", device("gpu-0"))], [GPU_CLASS, MIG_CLASS])
    assert not failure.value.in_use


def test_unknown_device_class_is_a_clear_error() -> None:
    # Tried: a request naming a class nobody created.
    with pytest.raises(Unsatisfiable, match="DeviceClass 'tpu.example.com' does not exist"):
        allocate(claim(request(cls="tpu.example.com")), [pool("node-a", device("gpu-0"))], [GPU_CLASS])


def test_a_claim_never_spans_nodes() -> None:
    # Tried: two GPUs when each of two nodes has one.
    slices = [pool("node-a", device("gpu-0")), pool("node-b", device("gpu-0"))]
    with pytest.raises(Unsatisfiable, match="not enough matching devices"):
        allocate(claim(request(count=2)), slices, [GPU_CLASS])


def test_node_argument_limits_the_search() -> None:
    slices = [pool("node-a", device("gpu-0")), pool("node-b", device("gpu-0"))]
    allocation = allocate(claim(request()), slices, [GPU_CLASS], node="node-b")
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["node-b"]


def test_only_the_newest_pool_generation_counts() -> None:
    slices = [pool("node-a", device("gpu-0"), generation=1), pool("node-a", device("gpu-9"), generation=2)]
    assert chosen(allocate(claim(request()), slices, [GPU_CLASS])) == ["gpu-9"]


def test_allocation_mode_all_takes_every_match_or_nothing() -> None:
    slices = [pool("node-a", device("gpu-0"), device("gpu-1"), device("mig-0", kind="mig"))]
    everything = claim({"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}})
    assert chosen(allocate(everything, slices, [GPU_CLASS, MIG_CLASS])) == ["gpu-0", "gpu-1"]
    # Tried: All while one of the matching GPUs is held elsewhere.
    with pytest.raises(Unsatisfiable):
        allocate(everything, slices, [GPU_CLASS, MIG_CLASS], [allocated("other", "gpu-1")])


def test_first_available_falls_back_to_the_next_subrequest() -> None:
    slices = [pool("node-a", device("gpu-0", "24Gi"))]
    big = "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('40Gi'))"
    wanted = claim(
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "big", "deviceClassName": "gpu.nvidia.com", "selectors": [{"cel": {"expression": big}}]},
                {"name": "any", "deviceClassName": "gpu.nvidia.com"},
            ],
        }
    )
    results = allocate(wanted, slices, [GPU_CLASS])["devices"]["results"]
    assert [(r["request"], r["device"]) for r in results] == [("gpu/any", "gpu-0")]


def test_configs_are_copied_from_class_and_claim() -> None:
    gpu_config = {"opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig", "from": "class"}}}
    device_class = {**GPU_CLASS, "spec": {**GPU_CLASS["spec"], "config": [gpu_config]}}
    claim_config = {
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig", "sharing": {"strategy": "MPS"}}},
    }
    allocation = allocate(claim(request(), config=[claim_config]), [pool("node-a", device("gpu-0"))], [device_class])
    # both name the claim's only request: written as for all requests (no `requests`), as kube-scheduler does
    assert allocation["devices"]["config"] == [
        {"source": "FromClass", **gpu_config},
        {"source": "FromClaim", "opaque": claim_config["opaque"]},
    ]


def test_no_config_means_no_config_field() -> None:
    allocation = allocate(claim(request()), [pool("node-a", device("gpu-0"))], [GPU_CLASS])
    assert "config" not in allocation["devices"]


def test_failing_selector_names_request_and_device() -> None:
    # Tried: a selector reading an attribute the device lacks.
    wanted = claim(request(selectors=("device.attributes['gpu.nvidia.com'].profile == '1g.10gb'",)))
    with pytest.raises(Unsatisfiable, match="request 'gpu', device gpu-0.*profile"):
        allocate(wanted, [pool("node-a", device("gpu-0"))], [GPU_CLASS])


# --- the shipped DeviceClasses and example claims against a published dgx-h100 ------------------------


def _examples() -> dict[str, dict]:
    docs = [d for f in sorted((DAEMONSET / "examples").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    return {
        d["metadata"]["name"]: {
            "metadata": {"name": d["metadata"]["name"], "uid": d["metadata"]["name"]},
            "spec": d["spec"]["spec"],
        }
        for d in docs
        if d and d["kind"] == "ResourceClaimTemplate"
    }


@pytest.fixture(scope="module")
def dgx_h100() -> tuple[list[dict], list[dict]]:
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    classes = list(yaml.safe_load_all((DAEMONSET / "base" / "deviceclasses.yaml").read_text()))
    return build_resource_slices(inventory, "dgx"), classes


@pytest.mark.parametrize("name", ["one-h100-80gb", "gpu-40gi", "time-sliced-gpu", "mps-shared-gpu"])
def test_single_gpu_examples_allocate_on_dgx_h100(dgx_h100: tuple[list[dict], list[dict]], name: str) -> None:
    slices, classes = dgx_h100
    allocation = allocate(_examples()[name], slices, classes)
    assert len(chosen(allocation)) == 1
    assert chosen(allocation)[0].startswith("gpu-")


def test_eight_nvlinked_example_gets_one_domain(dgx_h100: tuple[list[dict], list[dict]]) -> None:
    slices, classes = dgx_h100
    allocation = allocate(_examples()["eight-nvlinked-gpus"], slices, classes)
    devices = {d["name"]: d for d in slices[0]["spec"]["devices"]}
    assert len(set(chosen(allocation))) == 8
    assert len({str(devices[n]["attributes"]["nvlinkDomain"]) for n in chosen(allocation)}) == 1


def test_mps_example_config_reaches_the_allocation(dgx_h100: tuple[list[dict], list[dict]]) -> None:
    slices, classes = dgx_h100
    config = allocate(_examples()["mps-shared-gpu"], slices, classes)["devices"]["config"]
    assert [c["source"] for c in config] == ["FromClaim"]
    assert config[0]["opaque"]["parameters"]["sharing"]["strategy"] == "MPS"


def test_mig_example_is_unsatisfiable_on_dgx_h100(dgx_h100: tuple[list[dict], list[dict]]) -> None:
    # Tried: a 1g.10gb slice on GPUs not in MIG mode.
    slices, classes = dgx_h100
    with pytest.raises(Unsatisfiable, match="no matching device"):
        allocate(_examples()["mig-1g10gb"], slices, classes)
