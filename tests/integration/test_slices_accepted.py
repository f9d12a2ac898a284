"""The agent's ResourceSlices, as it builds them, written to both API servers: each one is accepted and comes
back as sent (an API server with a feature off silently drops that feature's fields; 1.37 has them all on)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from agent.slices.build import build_resource_slices
from tests.integration.conftest import Cluster
from tests.unit.test_slices_factory import dgx_h100

NODE = "node-a"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def publish(cluster: Cluster, slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Create every slice; the server's copies. A rejection fails with the server's message."""
    stored = []
    for body in slices:
        answer = cluster.raw("POST", SLICES, body)
        assert answer.status == 201, f"{body['metadata']['name']} rejected: {answer.body}"
        stored.append(answer.body)
    return stored


def tainted(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The health path's taints on gpu-3, as NVIDIA's driver writes them: an XID and a lost GPU."""
    out = copy.deepcopy(slices)
    for device in (d for s in out for d in s["spec"]["devices"] if d["name"] == "gpu-3"):
        device["taints"] = [
            {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"},
            {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoExecute"},
        ]
    return out


def test_plain_slices_are_accepted_unchanged(cluster: Cluster) -> None:
    slices = build_resource_slices(dgx_h100(), NODE)
    stored = publish(cluster, slices)
    assert [s["spec"] for s in stored] == [s["spec"] for s in slices]


def test_tainted_devices_are_accepted_and_the_taints_kept(cluster: Cluster) -> None:
    slices = tainted(build_resource_slices(dgx_h100(), NODE))
    stored = publish(cluster, slices)
    [gpu3] = [d for s in stored for d in s["spec"]["devices"] if d["name"] == "gpu-3"]
    assert [(t["key"], t["effect"]) for t in gpu3["taints"]] == [
        ("gpu.nvidia.com/xid", "NoSchedule"),
        ("gpu.nvidia.com/gpu-lost", "NoExecute"),
    ]
    assert all(t.get("timeAdded") for t in gpu3["taints"])  # defaulted by the server on create


COMBINED_REJECTED = "only one of `sharedCounters` or `devices` is allowed"


def counters_beside_devices(slices: list[dict[str, Any]]) -> bool:
    return any(s["spec"].get("sharedCounters") and s["spec"].get("devices") for s in slices)


def test_partitionable_slices_are_accepted_with_their_counters(cluster: Cluster) -> None:
    slices = build_resource_slices(dgx_h100(), NODE, partitionable=True)
    if counters_beside_devices(slices):
        # The 1.34 shape. Kubernetes 1.35+ wants counter sets in slices of their own.
        answer = cluster.raw("POST", SLICES, slices[0])
        if cluster.kind == "real" or answer.status != 201:
            assert answer.status == 422 and COMBINED_REJECTED in answer.body["message"], answer
            pytest.xfail("the agent puts sharedCounters and devices in one slice, which 1.35+ rejects")
        cluster.raw("DELETE", f"{SLICES}/{slices[0]['metadata']['name']}")
    stored = publish(cluster, slices)
    counters = [c for s in stored for c in s["spec"].get("sharedCounters", [])]
    consumers = [d for s in stored for d in s["spec"].get("devices", []) if d.get("consumesCounters")]
    assert len(counters) == 8 and consumers, "the server dropped the partitionable fields"
    assert {c["counterSet"] for d in consumers for c in d["consumesCounters"]} == {c["name"] for c in counters}
