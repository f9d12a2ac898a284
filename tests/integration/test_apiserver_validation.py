"""Writes rejected by the API fake with 422 and a reason: strict schemas of the version played and resource.k8s.io
rules."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from kubernetes import client, dynamic
from kubernetes.client import ApiException

import fakes.apiserver
from fakes.apiserver import ApiServer


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fakes.apiserver.start() as s:
        yield s


@pytest.fixture
def resource(server: ApiServer) -> client.ResourceV1Api:
    return client.ResourceV1Api(server.api_client())


def slice_body(name: str = "s1", devices: int = 1, pool: str = "node-a", generation: int = 1) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": pool, "generation": generation, "resourceSliceCount": 1},
            "nodeName": "node-a",
            "devices": [
                {
                    "name": f"gpu-{i}",
                    "attributes": {"type": {"string": "gpu"}},
                    "capacity": {"memory": {"value": "80Gi"}},
                }
                for i in range(devices)
            ],
        },
    }


def rejected(call) -> list[dict]:
    """The 422's causes; fails unless the call is rejected as Invalid."""
    with pytest.raises(ApiException) as err:
        call()
    status = json.loads(err.value.body)
    assert err.value.status == 422 and status["reason"] == "Invalid" and status["kind"] == "Status"
    return status["details"]["causes"]


def fields(causes: list[dict]) -> set[str]:
    return {c["field"] for c in causes}


def test_a_valid_full_slice_is_accepted(resource: client.ResourceV1Api) -> None:
    body = slice_body(devices=128)
    device = body["spec"]["devices"][0]
    device["attributes"].update(
        {
            "driverVersion": {"version": "580.65.6"},
            "numaNode": {"int": 0},
            "ready": {"bool": True},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:00"},
        }
    )
    assert len(resource.create_resource_slice(body).spec.devices) == 128


def test_129_devices(resource: client.ResourceV1Api) -> None:
    causes = rejected(lambda: resource.create_resource_slice(slice_body(devices=129)))
    assert {
        "field": "spec.devices",
        "reason": "FieldValueInvalid",
        "message": "must have at most 128 devices (is 129)",
    } in causes


def test_bad_device_name(resource: client.ResourceV1Api) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["name"] = "GPU_0"
    assert fields(rejected(lambda: resource.create_resource_slice(body))) == {"spec.devices[0].name"}


def test_both_node_name_and_all_nodes(resource: client.ResourceV1Api) -> None:
    body = slice_body()
    body["spec"]["allNodes"] = True
    causes = rejected(lambda: resource.create_resource_slice(body))
    assert "exactly one of nodeName, nodeSelector, allNodes, perDeviceNodeSelection" in causes[0]["message"]
    del body["spec"]["allNodes"], body["spec"]["nodeName"]
    assert fields(rejected(lambda: resource.create_resource_slice(body))) == {"spec"}  # and none at all


def test_long_string_and_bad_version_attributes(resource: client.ResourceV1Api) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["attributes"]["productName"] = {"string": "x" * 65}
    body["spec"]["devices"][0]["attributes"]["driverVersion"] = {"version": "580.65"}
    causes = rejected(lambda: resource.create_resource_slice(body))
    assert fields(causes) == {
        "spec.devices[0].attributes[productName]",
        "spec.devices[0].attributes[driverVersion].version",
    }
    assert any("no more than 64 characters (is 65)" in c["message"] for c in causes)


def test_attribute_limits_and_names(resource: client.ResourceV1Api) -> None:
    body = slice_body()
    device = body["spec"]["devices"][0]
    device["attributes"] = {f"a{i}": {"int": i} for i in range(32)}  # 32 attributes + 1 capacity
    device["attributes"]["bad-name"] = {"int": 1}  # not a C identifier
    device["attributes"]["both"] = {"int": 1, "string": "x"}  # two values
    causes = rejected(lambda: resource.create_resource_slice(body))
    assert fields(causes) == {
        "spec.devices[0]",
        "spec.devices[0].attributes[bad-name]",
        "spec.devices[0].attributes[both]",
    }


def raw(server: ApiServer, api_version: str, kind: str) -> dynamic.Resource:
    """The dynamic client sends dicts as they are; the typed API checks them client-side first."""
    return dynamic.DynamicClient(server.api_client()).resources.get(api_version=api_version, kind=kind)


def test_schema_rejects_wrong_types(server: ApiServer) -> None:
    body = slice_body()
    body["spec"]["pool"]["generation"] = "one"
    causes = rejected(lambda: raw(server, "resource.k8s.io/v1", "ResourceSlice").create(body=body))
    assert fields(causes) == {"spec.pool.generation"}


def post(server: ApiServer, path: str, body: dict, query: str = "") -> tuple[int, dict, dict]:
    """A raw POST (the typed client refuses unknown fields before sending): status, headers, decoded body."""
    request = urllib.request.Request(
        f"{server.url}{path}?{query}",
        json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_unknown_fields_follow_field_validation(server: ApiServer) -> None:
    body = slice_body()
    body["spec"]["devices"][0]["colour"] = "red"
    path = "/apis/resource.k8s.io/v1/resourceslices"
    # Strict (what kubectl --validate=strict asks for) refuses to decode the body: 400, nothing stored.
    code, _, status = post(server, path, body, "fieldValidation=Strict")
    assert code == 400 and 'strict decoding error: unknown field "spec.devices[0].colour"' in status["message"]
    assert server.store.get("ResourceSlice", "s1") is None
    # The default (Warn) drops the field, stores the rest and says so in a Warning header, as kube-apiserver does.
    code, headers, _ = post(server, path, body)
    assert code == 201 and headers["Warning"] == '299 - "unknown field \\"spec.devices[0].colour\\""'
    assert "colour" not in server.store.get("ResourceSlice", "s1")["spec"]["devices"][0]
    # Ignore drops it silently.
    body["metadata"]["name"] = "s2"
    body["spec"]["pool"]["name"] = "node-b"
    code, headers, created = post(server, path, body, "fieldValidation=Ignore")
    assert code == 201 and "Warning" not in headers and "colour" not in created["spec"]["devices"][0]


def test_duplicate_device_names_in_a_pool(resource: client.ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body("s1"))
    # kube-apiserver validates one slice at a time: another slice of the pool repeating gpu-0 is stored, and
    # it is the scheduler's allocator that then treats the whole pool as invalid.
    resource.create_resource_slice(slice_body("s2"))
    assert {s.metadata.name for s in resource.list_resource_slice().items} == {"s1", "s2"}
    # Within one slice, a repeated name is invalid.
    body = slice_body("s3", devices=2)
    body["spec"]["devices"][1]["name"] = "gpu-0"
    assert fields(rejected(lambda: resource.create_resource_slice(body))) == {"spec.devices[1].name"}


def test_slice_driver_pool_and_node_are_immutable(resource: client.ResourceV1Api) -> None:
    resource.create_resource_slice(slice_body())
    causes = rejected(lambda: resource.patch_resource_slice("s1", {"spec": {"pool": {"name": "other"}}}))
    assert fields(causes) == {"spec.pool.name"}


def partitionable() -> dict:
    body = slice_body(devices=2)
    body["spec"]["sharedCounters"] = [{"name": "gpu-0-counters", "counters": {"memory": {"value": "80Gi"}}}]
    for device in body["spec"]["devices"]:
        device["consumesCounters"] = [{"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "40Gi"}}}]
    return body


def test_counters_are_kept_and_checked_on_1_34_with_the_gate_on() -> None:
    """1.34 rules (validateResourceSliceSpec of release-1.34): counters beside devices, 32 counters over all sets."""
    with fakes.apiserver.start(kubernetes_version="1.34", feature_gates={"DRAPartitionableDevices": True}) as server:
        resource = client.ResourceV1Api(server.api_client())
        created = resource.create_resource_slice(partitionable())
        assert created.spec.shared_counters[0].name == "gpu-0-counters"
        assert created.spec.devices[0].consumes_counters[0].counter_set == "gpu-0-counters"
        body = partitionable()
        body["metadata"]["name"] = "s2"
        body["spec"]["pool"]["name"] = "other"
        body["spec"]["devices"][1]["consumesCounters"][0]["counterSet"] = "missing"
        body["spec"]["sharedCounters"].append({"name": "gpu-0-counters", "counters": {"x": {"value": "1"}}})
        causes = rejected(lambda: resource.create_resource_slice(body))
        assert fields(causes) == {"spec.sharedCounters[1].name", "spec.devices[1].consumesCounters[0].counterSet"}
        body = partitionable()
        body["metadata"]["name"] = "s3"
        body["spec"]["sharedCounters"][0]["counters"] = {f"c{i}": {"value": "1"} for i in range(33)}
        body["spec"]["devices"] = []
        assert fields(rejected(lambda: resource.create_resource_slice(body))) == {"spec.sharedCounters"}


def test_server_without_partitionable_devices_drops_counters() -> None:
    with fakes.apiserver.start(drop_partitionable_fields=True) as server:
        created = client.ResourceV1Api(server.api_client()).create_resource_slice(partitionable())
        assert created.spec.shared_counters is None
        assert all(d.consumes_counters is None for d in created.spec.devices)
        assert "sharedCounters" not in server.store.get("ResourceSlice", "s1")["spec"]


def test_claim_rules(server: ApiServer, resource: client.ResourceV1Api) -> None:
    requests = [
        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All", "count": 2}},
        {
            "name": "gpu",
            "exactly": {"deviceClassName": "gpu.nvidia.com"},
            "firstAvailable": [{"name": "a", "deviceClassName": "gpu.nvidia.com"}],
        },
    ]
    body = {"metadata": {"name": "c"}, "spec": {"devices": {"requests": requests}}}
    causes = rejected(lambda: resource.create_namespaced_resource_claim("default", body))
    assert fields(causes) == {
        "spec.devices.requests[0].exactly.count",
        "spec.devices.requests[1].name",
        "spec.devices.requests[1]",
    }


def test_metadata_rules_apply_to_every_type(server: ApiServer) -> None:
    core = client.CoreV1Api(server.api_client())
    causes = rejected(lambda: core.create_node({"metadata": {"name": "Bad_Node", "labels": {"k": "v" * 64}}}))
    assert fields(causes) == {"metadata.name", "metadata.labels[k]"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "c", "image": 1}]},
    }
    assert fields(rejected(lambda: raw(server, "v1", "Pod").create(body=pod, namespace="default"))) == {
        "spec.containers[0].image"
    }
