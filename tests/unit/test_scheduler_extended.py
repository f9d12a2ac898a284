"""The fake scheduler's DRAExtendedResource and device taints, pure: claims shaped as kube-scheduler shapes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.slices.build import build_resource_slices
from agent.slices.taints import xid_taint
from agent.slices.versions import rules_for
from fakes.scheduler import Unsatisfiable, allocate
from fakes.scheduler.extended import (
    CLAIM_ANNOTATION,
    claim_for,
    class_mapping,
    device_requests,
    find_claim,
    request_mappings,
)
from tests.unit.test_slices_factory import dgx_h100

DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"
CLASSES = [d for d in yaml.safe_load_all((DAEMONSET / "base" / "deviceclasses.yaml").read_text()) if d]


def pod(*containers: dict, init: tuple[dict, ...] = ()) -> dict:
    return {
        "metadata": {"name": "trainer", "namespace": "ml", "uid": "pod-uid-1"},
        "spec": {"initContainers": list(init), "containers": list(containers)},
    }


def container(name: str, limits: dict | None = None, requests: dict | None = None) -> dict:
    return {"name": name, "image": "cuda", "resources": {"limits": limits or {}, "requests": requests or {}}}


def test_the_gpu_class_maps_nvidia_com_gpu_and_every_class_its_implicit_name() -> None:
    mapping = class_mapping(CLASSES)
    assert mapping["nvidia.com/gpu"] == "gpu.nvidia.com"
    assert mapping["deviceclass.resource.kubernetes.io/mig.nvidia.com"] == "mig.nvidia.com"
    assert "nvidia.com/mig" not in mapping


def test_requests_are_named_by_container_index_and_sorted_resource_index() -> None:
    """Upstream's createDeviceRequests: `container-<i>-request-<j>`, i over initContainers then containers, j the
    resource's index among the container's sorted request names; a limit alone counts as the request."""
    p = pod(
        container("main", limits={"nvidia.com/gpu": "2"}, requests={"cpu": "4", "memory": "8Gi"}),
        container("sidecar", requests={"cpu": "1"}),
        init=(container("warmup", limits={"deviceclass.resource.kubernetes.io/mig.nvidia.com": "1"}),),
    )
    requests = device_requests(p, class_mapping(CLASSES))
    assert requests == [
        {
            "name": "container-0-request-0",
            "exactly": {"deviceClassName": "mig.nvidia.com", "allocationMode": "ExactCount", "count": 1},
        },
        {
            "name": "container-1-request-2",  # cpu, memory, nvidia.com/gpu
            "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 2},
        },
    ]
    claim = claim_for(p, requests)
    assert claim["metadata"]["generateName"] == "trainer-extended-resources-"
    assert claim["metadata"]["annotations"] == {CLAIM_ANNOTATION: "true"}
    assert claim["metadata"]["ownerReferences"][0] | {} == {
        "apiVersion": "v1",
        "kind": "Pod",
        "name": "trainer",
        "uid": "pod-uid-1",
        "controller": True,
        "blockOwnerDeletion": True,
    }
    assert request_mappings(p, claim) == [
        {
            "containerName": "warmup",
            "resourceName": "deviceclass.resource.kubernetes.io/mig.nvidia.com",
            "requestName": "container-0-request-0",
        },
        {"containerName": "main", "resourceName": "nvidia.com/gpu", "requestName": "container-1-request-2"},
    ]
    named = {**claim, "metadata": {**claim["metadata"], "name": "trainer-extended-resources-x1"}}
    assert find_claim(p, [named])["metadata"]["name"] == "trainer-extended-resources-x1"
    other = {**p, "metadata": {**p["metadata"], "uid": "another-pod"}}
    assert find_claim(other, [named]) is None  # the same name, another pod: not its claim


def test_a_node_whose_device_plugin_offers_the_resource_needs_no_claim() -> None:
    p = pod(container("main", limits={"nvidia.com/gpu": "1"}))
    assert device_requests(p, class_mapping(CLASSES), {"nvidia.com/gpu": "8"}) == []
    assert device_requests(p, class_mapping(CLASSES), {"nvidia.com/gpu": "0"}) != []
    assert device_requests(pod(container("main", limits={"example.com/fpga": "1"})), class_mapping(CLASSES)) == []


def test_tainted_devices_are_allocated_only_to_requests_that_tolerate_them() -> None:
    """Tried: Xid 79 on gpu-0..gpu-6 of a DGX H100 (1.37 slices carry the taints): one GPU is left."""
    taints = {f"gpu-{i}": [xid_taint("gpu.nvidia.com", 79, 1_795_000_000)] for i in range(7)}
    slices = build_resource_slices(dgx_h100(), "node-a", rules=rules_for("1.37"), taints=taints)
    p = pod(container("main", limits={"nvidia.com/gpu": "1"}))
    claim = claim_for(p, device_requests(p, class_mapping(CLASSES)))
    (result,) = allocate(claim, slices, CLASSES)["devices"]["results"]
    assert result["device"] == "gpu-7"
    claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    with pytest.raises(Unsatisfiable):
        allocate(claim, slices, CLASSES)
    claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = [
        {"key": "gpu.nvidia.com/xid", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert len(allocate(claim, slices, CLASSES)["devices"]["results"]) == 2
    claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = [
        {"key": "gpu.nvidia.com/xid", "operator": "Equal", "value": "48"}
    ]  # another Xid: not tolerated
    with pytest.raises(Unsatisfiable):
        allocate(claim, slices, CLASSES)
    # No key with Equal: any key with that value, as resourceclaim.ToleratesTaint reads it (the fake once
    # wanted the key empty too, and refused this claim).
    claim["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = [{"operator": "Equal", "value": "79"}]
    assert len(allocate(claim, slices, CLASSES)["devices"]["results"]) == 2
