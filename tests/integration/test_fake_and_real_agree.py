"""The API server fake answers as kube-apiserver 1.37 does: the same requests to both, the same answers.

Each test runs against the fake and the real control plane (the `cluster` fixture). Where the fake still
disagrees in an area being reworked in fakes/apiserver/ (per-version behaviour, Table output, DELETE
bodies), the fake's case is marked xfail with the disagreement as its reason; the real case pins what
the fake must do.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.integration.conftest import Cluster

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}


def slice_body(name: str, devices: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
            "nodeName": "node-a",
            "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(devices)],
        },
    }


def claim_body(name: str, **exactly: Any) -> dict[str, Any]:
    request = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", **exactly}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [request]}},
    }


def fake_disagrees(cluster: Cluster, agrees: bool, why: str) -> None:
    """Mark the fake's case xfail while it still answers differently; the assertions that follow pin the answer."""
    if cluster.kind == "fake" and not agrees:
        pytest.xfail(f"fake disagrees with kube-apiserver 1.37: {why}")


def test_claim_requests_are_defaulted(cluster: Cluster) -> None:
    created = cluster.raw("POST", CLAIMS, claim_body("one"))
    assert created.status == 201, created
    assert created.body["spec"]["devices"]["requests"][0]["exactly"] == {
        "deviceClassName": "gpu.nvidia.com",
        "allocationMode": "ExactCount",
        "count": 1,
    }
    every = cluster.raw("POST", CLAIMS, claim_body("every", allocationMode="All"))
    assert every.status == 201, every
    assert "count" not in every.body["spec"]["devices"]["requests"][0]["exactly"]  # All takes no count


def test_already_exists_and_not_found_read_alike(cluster: Cluster) -> None:
    assert cluster.raw("POST", SLICES, slice_body("s1")).status == 201
    again = cluster.raw("POST", SLICES, slice_body("s1"))
    assert (again.status, again.body["reason"]) == (409, "AlreadyExists")
    assert again.body["message"] == 'resourceslices.resource.k8s.io "s1" already exists'
    assert again.body["details"] == {"name": "s1", "group": "resource.k8s.io", "kind": "resourceslices"}
    missing = cluster.raw("GET", f"{SLICES}/missing")
    assert (missing.status, missing.body["reason"]) == (404, "NotFound")
    assert missing.body["message"] == 'resourceslices.resource.k8s.io "missing" not found'
    assert missing.body["details"] == {"name": "missing", "group": "resource.k8s.io", "kind": "resourceslices"}


def test_stale_resource_version_is_a_conflict(cluster: Cluster) -> None:
    created = cluster.raw("POST", SLICES, slice_body("s1")).body
    assert cluster.raw("PATCH", f"{SLICES}/s1", {"metadata": {"labels": {"bump": "1"}}}).status == 200
    stale = copy.deepcopy(created)
    stale["metadata"]["labels"] = {"stale": "yes"}
    answer = cluster.raw("PUT", f"{SLICES}/s1", stale)
    assert (answer.status, answer.body["reason"]) == (409, "Conflict")
    assert answer.body["message"] == (
        'Operation cannot be fulfilled on resourceslices.resource.k8s.io "s1": '
        "the object has been modified; please apply your changes to the latest version and try again"
    )


def test_delete_answers_with_the_deleted_object_or_a_status(cluster: Cluster) -> None:
    """resource.k8s.io types answer DELETE with the object (as pods do); nodes with a Success status."""
    cluster.raw("POST", SLICES, slice_body("s1"))
    cluster.add_node("node-x")
    node_gone = cluster.raw("DELETE", "/api/v1/nodes/node-x")
    assert (node_gone.status, node_gone.body["kind"], node_gone.body["status"]) == (200, "Status", "Success")
    assert node_gone.body["details"]["name"] == "node-x" and node_gone.body["details"]["kind"] == "nodes"
    slice_gone = cluster.raw("DELETE", f"{SLICES}/s1")
    assert slice_gone.status == 200
    answered_object = slice_gone.body.get("kind") == "ResourceSlice"
    fake_disagrees(cluster, answered_object, "DELETE of a ResourceSlice answers a Status")
    assert (slice_gone.body["kind"], slice_gone.body["metadata"]["name"]) == ("ResourceSlice", "s1")


def test_table_columns_are_kubectl_s(cluster: Cluster) -> None:
    cluster.raw("POST", SLICES, slice_body("s1"))
    cluster.raw("POST", CLAIMS, claim_body("c1"))
    slices = cluster.raw("GET", SLICES, headers=TABLE)
    claims = cluster.raw("GET", CLAIMS, headers=TABLE)
    fake_disagrees(cluster, slices.status == 200 and slices.body.get("kind") == "Table", "no server-side Table output")
    assert [c["name"] for c in slices.body["columnDefinitions"]] == ["Name", "Node", "Driver", "Pool", "Age"]
    assert [r["cells"][:4] for r in slices.body["rows"]] == [["s1", "node-a", "gpu.nvidia.com", "node-a"]]
    assert [c["name"] for c in claims.body["columnDefinitions"]] == ["Name", "State", "Age"]
    assert [r["cells"][:2] for r in claims.body["rows"]] == [["c1", "pending"]]


def test_too_many_devices_is_invalid_with_the_field_named(cluster: Cluster) -> None:
    answer = cluster.raw("POST", SLICES, slice_body("big", devices=129))
    assert (answer.status, answer.body["reason"]) == (422, "Invalid")
    assert answer.body["message"].startswith('ResourceSlice.resource.k8s.io "big" is invalid: spec.devices')
    assert "spec.devices" in {c.get("field") for c in answer.body["details"]["causes"]}


def test_a_claim_in_a_missing_namespace_is_not_found(cluster: Cluster) -> None:
    answer = cluster.raw("POST", CLAIMS.replace("/default/", "/nowhere/"), claim_body("c1"))
    assert (answer.status, answer.body["reason"]) == (404, "NotFound")
    assert answer.body["message"] == 'namespaces "nowhere" not found'


def test_a_pool_s_slices_may_repeat_device_names_but_one_slice_may_not(cluster: Cluster) -> None:
    """Validation is per slice; duplicates across a pool's slices are the allocator's problem, not a 422."""
    assert cluster.raw("POST", SLICES, slice_body("s1")).status == 201
    assert cluster.raw("POST", SLICES, slice_body("s2")).status == 201
    twice = slice_body("s3", devices=2)
    twice["spec"]["devices"][1]["name"] = "gpu-0"
    answer = cluster.raw("POST", SLICES, twice)
    assert answer.status == 422
    assert [c["field"] for c in answer.body["details"]["causes"]] in (["spec.devices[1]"], ["spec.devices[1].name"])


def test_an_allocation_must_name_a_request_of_the_claim(cluster: Cluster) -> None:
    cluster.raw("POST", CLAIMS, claim_body("c1"))
    result = {"request": "nope", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}
    status = {"status": {"allocation": {"devices": {"results": [result]}}}}
    answer = cluster.raw("PATCH", f"{CLAIMS}/c1/status", status)
    assert (answer.status, answer.body["reason"]) == (422, "Invalid")
    assert [c["field"] for c in answer.body["details"]["causes"]] == ["status.allocation.devices.results[0].request"]
    result["request"] = "gpu"
    assert cluster.raw("PATCH", f"{CLAIMS}/c1/status", status).status == 200


def test_an_unknown_patch_type_is_415_before_the_object_is_looked_up(cluster: Cluster) -> None:
    answer = cluster.raw("PATCH", f"{SLICES}/missing", b"{}", headers={"Content-Type": "text/plain"})
    assert (answer.status, answer.body["reason"]) == (415, "UnsupportedMediaType")
