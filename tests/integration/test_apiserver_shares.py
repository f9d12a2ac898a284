"""Consumable capacity in the API fake, per version: slices with allowMultipleAllocations and request policies
kept from 1.36 (DRAConsumableCapacity beta, on) and dropped before; upstream's requestPolicy validation
(pkg/apis/resource/validation validateRequestPolicyRange); claims' capacity requests and shareIDs; and the
publisher falling back to whole GPUs, with one warning, where the server cannot keep shares."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from agent.devices.shares import ShareMode
from agent.nvml.source import open_nvml
from agent.slices.publisher import Publisher
from fakes.apiserver import ApiServer
from tests.integration.test_apiserver_versions import create_slice, device, invalid_fields, serve, slice_body


@pytest.fixture
def api_server() -> Iterator[ApiServer]:
    with serve("1.37") as s:
        yield s


def shared(value: str = "80Gi", **policy: Any) -> dict[str, Any]:
    default = policy.pop("default", "80Gi")
    valid_range = {"min": "1Mi", "max": value, "step": "1Mi", **policy}
    return device(
        0,
        allowMultipleAllocations=True,
        capacity={"memory": {"value": value, "requestPolicy": {"default": default, "validRange": valid_range}}},
    )


@pytest.mark.parametrize(("version", "kept"), [("1.34", False), ("1.35", False), ("1.36", True), ("1.37", True)])
def test_shareable_devices_are_kept_from_1_36(version: str, kept: bool) -> None:
    with serve(version) as server:
        created = create_slice(server, slice_body(devices=[shared()]))
        assert (created.spec.devices[0].allow_multiple_allocations is True) == kept
        assert (created.spec.devices[0].capacity["memory"].request_policy is not None) == kept


def test_request_policy_rules(api_server: ApiServer) -> None:
    server = api_server
    create_slice(server, slice_body("ok", devices=[shared()]))
    at = "spec.devices[0].capacity[memory].requestPolicy"
    assert invalid_fields(lambda: create_slice(server, slice_body("max", devices=[shared(max="90Gi")]))) == {
        f"{at}.validRange.max": "max is larger than capacity value: 80Gi"
    }
    off_grid = shared(default="1000Ki")
    assert invalid_fields(lambda: create_slice(server, slice_body("grid", devices=[off_grid])))[
        f"{at}.validRange.step"
    ].startswith("value is not a multiple of a given step (1Mi) from (1Mi)")
    exclusive = device(0, capacity={"memory": {"value": "80Gi", "requestPolicy": {"default": "1Gi"}}})
    assert invalid_fields(lambda: create_slice(server, slice_body("ex", devices=[exclusive]))) == {
        at: "Forbidden: allowMultipleAllocations must be true"
    }


def test_claims_capacity_requests_and_share_ids(api_server: ApiServer) -> None:
    server = api_server
    api = client.ResourceV1Api(server.api_client())
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {"deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": "-1Gi"}}},
                    }
                ]
            }
        },
    }
    # kube-apiserver 1.37 takes a negative request (tests/integration/test_apiserver_selector_cel.py); the node
    # refuses to prepare it
    api.create_namespaced_resource_claim("default", {**body, "metadata": {"name": "negative", "namespace": "default"}})
    body["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]["memory"] = "8Gi"
    claim = api.create_namespaced_resource_claim("default", body, _preload_content=False)
    stored = json.loads(claim.data)
    result = {
        "request": "gpu",
        "driver": "gpu.nvidia.com",
        "pool": "n",
        "device": "gpu-0",
        "shareID": "not-a-uid",
        "consumedCapacity": {"memory": "8Gi"},
    }
    stored["status"] = {"allocation": {"devices": {"results": [result]}}}
    assert invalid_fields(lambda: api.replace_namespaced_resource_claim_status("c", "default", stored)) == {
        "status.allocation.devices.results[0].shareID": "invalid UID 'not-a-uid'"
    }
    result["shareID"] = "0b0e7a52-3c3a-4b8e-9d55-6f6e2f0b8a11"
    stored["status"]["allocation"]["devices"]["results"] = [result, dict(result)]
    assert "status.allocation.devices.results[1]" in invalid_fields(
        lambda: api.replace_namespaced_resource_claim_status("c", "default", stored)
    )
    stored["status"]["allocation"]["devices"]["results"] = [result]
    api.replace_namespaced_resource_claim_status("c", "default", stored)


@pytest.mark.parametrize(("version", "shareable"), [("1.35", False), ("1.36", True)])
def test_the_publisher_falls_back_to_whole_gpus_with_one_warning(
    version: str, shareable: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    with serve(version) as server, caplog.at_level(logging.WARNING):
        publisher = Publisher(server.rest(), "node-a", share_mode=ShareMode("memory"))
        publisher.publish(inventory)
        publisher.resync(inventory)
        devices = [d for s in server.store.objects("ResourceSlice") for d in s["spec"]["devices"]]
    assert all(d.get("allowMultipleAllocations", False) is shareable for d in devices)
    assert (publisher.share_mode is not None) == shareable
    warnings = [r.getMessage() for r in caplog.records if "consumable-shares" in r.getMessage()]
    assert len(warnings) == (0 if shareable else 1)
    if not shareable:
        assert "needs Kubernetes 1.36 or later" in warnings[0]


def test_a_server_with_the_gate_off_drops_shares_and_the_publisher_follows(caplog: pytest.LogCaptureFixture) -> None:
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    with serve("1.36", feature_gates={"DRAConsumableCapacity": False}) as server, caplog.at_level(logging.WARNING):
        publisher = Publisher(server.rest(), "node-a", share_mode=ShareMode("memory"))
        publisher.publish(inventory)
        publisher.resync(inventory)
        devices = [d for s in server.store.objects("ResourceSlice") for d in s["spec"]["devices"]]
    assert devices and not any(d.get("allowMultipleAllocations") for d in devices)
    assert publisher.share_mode is None
    assert [r.getMessage() for r in caplog.records if "allowMultipleAllocations" in r.getMessage()] == [
        "the API server dropped allowMultipleAllocations from ResourceSlice writes (feature gate DRAConsumableCapacity "
        "is off); publishing whole GPUs without consumable shares"
    ]


def test_published_shares_are_accepted_by_every_version_that_keeps_them() -> None:
    with open_nvml("fake:dgx-h100") as nvml:
        inventory = nvml.discover()
    for version in ("1.36", "1.37"):
        with serve(version) as server:
            Publisher(server.rest(), "node-a", share_mode=ShareMode("count", 4)).publish(inventory)
            [s] = server.store.objects("ResourceSlice")
            assert s["spec"]["devices"][0]["capacity"]["shares"]["value"] == "4"


@pytest.mark.parametrize(("version", "kept"), [("1.35", False), ("1.36", True)])
def test_share_ids_in_claim_status_are_kept_from_1_36(version: str, kept: bool) -> None:
    with serve(version) as server:
        api = client.ResourceV1Api(server.api_client())
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "c", "namespace": "default"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu.nvidia.com",
                                "capacity": {"requests": {"memory": "8Gi"}},
                            },
                        }
                    ]
                }
            },
        }
        stored = json.loads(api.create_namespaced_resource_claim("default", body, _preload_content=False).data)
        assert ("capacity" in stored["spec"]["devices"]["requests"][0]["exactly"]) == kept
        stored["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.nvidia.com",
                            "pool": "n",
                            "device": "gpu-0",
                            "shareID": "0b0e7a52-3c3a-4b8e-9d55-6f6e2f0b8a11",
                            "consumedCapacity": {"memory": "8Gi"},
                        }
                    ]
                }
            }
        }
        written = json.loads(
            api.replace_namespaced_resource_claim_status("c", "default", stored, _preload_content=False).data
        )
        [result] = written["status"]["allocation"]["devices"]["results"]
        assert ("shareID" in result, "consumedCapacity" in result) == (kept, kept)
