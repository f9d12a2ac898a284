"""`status.allocation.devices.config` as kube-scheduler writes it, and as the arbiter and the fake kube-scheduler
write it (both with agent.objects.write.device_config). They rendered it apart, with other rules: the fake kept
a claim config for a subrequest not chosen and named each request in its own class entry, the arbiter dropped
the config's other request names; neither cleared `requests` where they cover the whole claim (issue 34,
item 2). One claim, allocated by kube-scheduler with no arbiter: on the API fake (its kube-scheduler stand-in)
and on the real control plane (kube-scheduler 1.37.2), the same config, and the one device_config renders."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent.kube.rest import DEVICE_CLASSES, PODS, RESOURCE_CLAIMS
from agent.objects.read import claim_requests, request_options
from agent.objects.write import device_config
from fakes.cluster import FakeCluster, wait_for
from tests.integration.conftest import FAKE_AND_REAL, fake_or_real_world

NS = "configs"
CONFIGURED = "configured-gpu.example.com"  # a class of the driver's GPUs that carries a config


def opaque(tag: str) -> dict[str, Any]:
    return {"opaque": {"driver": "other.example.com", "parameters": {"apiVersion": "example.com/v1", "kind": tag}}}


CLAIM_CONFIG = [
    {"requests": ["a/nine"], **opaque("for-a-nine")},  # a subrequest not chosen: dropped
    {"requests": ["a/one"], **opaque("for-a-one")},
    {"requests": ["b", "c"], **opaque("for-b-and-c")},
    opaque("for-all"),
    {"requests": ["a", "b", "c"], **opaque("names-all")},  # covers every request: written as for all
]


@pytest.fixture(params=FAKE_AND_REAL)
def cluster(request: pytest.FixtureRequest) -> Iterator[FakeCluster]:
    yield from fake_or_real_world(request, nodes=1, namespaces=[NS])


def _allocated(cluster: FakeCluster) -> dict[str, Any] | None:
    claim = cluster.rest.get(RESOURCE_CLAIMS, NS, "mixed")
    return claim if (claim.get("status") or {}).get("allocation") else None


def test_the_allocation_s_config_is_kube_scheduler_s(cluster: FakeCluster) -> None:
    cluster.namespace(NS)
    configured = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": CONFIGURED},
        "spec": {
            "selectors": [
                {
                    "cel": {
                        "expression": "device.driver == 'gpu.nvidia.com' && "
                        "device.attributes['gpu.nvidia.com'].type == 'gpu'"
                    }
                }
            ],
            "config": [opaque("from-class")],
        },
    }
    cluster.rest.create(DEVICE_CLASSES, None, configured)
    cluster.rest.create(
        RESOURCE_CLAIMS,
        NS,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "mixed", "namespace": NS},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "a",
                            "firstAvailable": [
                                {"name": "nine", "deviceClassName": CONFIGURED, "count": 9},
                                {"name": "one", "deviceClassName": CONFIGURED, "count": 1},
                            ],
                        },
                        {"name": "b", "exactly": {"deviceClassName": CONFIGURED}},
                        {"name": "c", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
                    ],
                    "config": CLAIM_CONFIG,
                }
            },
        },
    )
    cluster.rest.create(
        PODS,
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p", "namespace": NS},
            "spec": {
                "containers": [{"name": "main", "image": "trainer:1"}],
                "resourceClaims": [{"name": "gpus", "resourceClaimName": "mixed"}],
                "terminationGracePeriodSeconds": 0,
            },
        },
    )
    claim = wait_for(lambda: _allocated(cluster), timeout=90, interval=0.2, what="the claim allocated")
    written = claim["status"]["allocation"]["devices"]["config"]
    assert written == [
        {"source": "FromClass", "requests": ["a/one", "b"], **opaque("from-class")},
        {"source": "FromClaim", "requests": ["a/one"], **opaque("for-a-one")},
        {"source": "FromClaim", "requests": ["b", "c"], **opaque("for-b-and-c")},
        {"source": "FromClaim", **opaque("for-all")},
        {"source": "FromClaim", **opaque("names-all")},
    ]
    picked = {r["request"] for r in claim["status"]["allocation"]["devices"]["results"]}
    choice = tuple(
        next(i for i, (name, _) in enumerate(request_options(r)) if name in picked) for r in claim_requests(claim)
    )
    classes = {c["metadata"]["name"]: c for c in cluster.rest.list(DEVICE_CLASSES, None)["items"]}
    assert device_config(claim, classes, choice) == written  # what the arbiter writes for the same choice
