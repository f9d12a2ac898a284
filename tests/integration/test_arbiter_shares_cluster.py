"""Consumable-capacity shares placed by the arbiter (the only allocator of the driver's devices): gated share
claims of a queue are reserved by the node on one GPU, written as kube-scheduler writes shares, and prepared."""

from __future__ import annotations

import pathlib
import re
from collections.abc import Iterator
from typing import Any

import pytest

from agent.claims import cdi
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef
from agent.devices.shares import ShareMode
from agent.kube.claims import KubeClaimSource
from agent.kube.rest import PODS, QUEUES, RESOURCE_CLAIMS
from agent.names import GATE, QUEUE_LABEL
from fakes.cluster import FakeCluster, wait_for

pytestmark = pytest.mark.slow
NS = "inference"
NODE = "gpu-node-0"
MEMORY = ShareMode("memory")
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")  # RFC 4122 v4


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(nodes=1, share_mode=MEMORY) as c:
        c.queue("root")
        c.queue("serving", parent="root", gpu_quota=1)
        yield c


def share_pod(cluster: FakeCluster, name: str, memory: str = "8Gi") -> None:
    cluster.namespace(NS)
    cluster.rest.create(
        RESOURCE_CLAIMS,
        NS,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu.nvidia.com",
                                "capacity": {"requests": {"memory": memory}},
                            },
                        }
                    ]
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
            "metadata": {"name": name, "namespace": NS, "labels": {QUEUE_LABEL: "serving"}},
            "spec": {
                "schedulingGates": [{"name": GATE}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [
                    {
                        "name": "main",
                        "image": "server:1",
                        "resources": {"requests": {"cpu": "1", "memory": "4Gi"}, "claims": [{"name": "gpu"}]},
                    }
                ],
            },
        },
    )


def bound(cluster: FakeCluster, names: list[str]) -> list[dict[str, Any]] | None:
    pods = {p["metadata"]["name"]: p for p in cluster.pods(NS)}
    return [pods[n] for n in names] if all(pods.get(n, {}).get("spec", {}).get("nodeName") for n in names) else None


def results(cluster: FakeCluster, name: str) -> list[dict[str, Any]]:
    claim = cluster.rest.get(RESOURCE_CLAIMS, NS, name)
    return list(claim["status"]["allocation"]["devices"]["results"])


def test_gated_share_claims_of_a_queue_are_admitted_onto_one_gpu_and_prepared(
    cluster: FakeCluster, tmp_path: pathlib.Path
) -> None:
    names = [f"llm-{i}" for i in range(9)]
    for name in names:
        share_pod(cluster, name)
    cluster.arbiter()
    pods = wait_for(lambda: bound(cluster, names), timeout=60, what="the nine share pods bound")
    assert {p["spec"]["nodeName"] for p in pods} == {NODE}

    # each claim holds a share of one GPU, written as kube-scheduler writes one
    shares = [r for name in names for r in results(cluster, name)]
    assert {(r["pool"], r["device"]) for r in shares} == {(NODE, shares[0]["device"])}
    assert all(UUID.match(r["shareID"]) for r in shares) and len({r["shareID"] for r in shares}) == 9
    assert all(r["consumedCapacity"] == {"memory": "8Gi", "shares": "1"} for r in shares)

    # a tenth does not fit beside them (9 x 8Gi of 79.6 GiB): it gets a share of another GPU
    share_pod(cluster, "llm-9")
    wait_for(lambda: bound(cluster, ["llm-9"]), timeout=60, what="the tenth share pod bound")
    [tenth] = results(cluster, "llm-9")
    assert tenth["pool"] == NODE and tenth["device"] != shares[0]["device"]

    # the queue counts the nine and the tenth as the fractions they are: 80/79.6, not ten GPUs
    def allocated() -> float:
        return float(
            ((cluster.rest.get(QUEUES, None, "serving").get("status") or {}).get("allocated") or {}).get("gpu", 0)
        )

    wait_for(lambda: allocated() == pytest.approx(1.004, abs=0.001), timeout=30, what="the queue's status")

    # the node prepares every share, each its own CDI device, beside the others on the GPU
    agent = cluster.agents[NODE]
    assert cluster.server is not None
    preparer = ClaimPreparer(
        PrepareSettings(
            node_name=NODE,
            driver_name="gpu.nvidia.com",
            inventory=lambda: cluster.inventory,
            mig_caps=cdi.MigCaps(lambda: None),
            reserved=agent.book.reserved_for_other,
            share_mode=MEMORY,
        ),
        state_dir=tmp_path / "state",
        cdi_root=tmp_path / "cdi",
        source=KubeClaimSource(cluster.server.rest()),
        boot_id=lambda: "boot-1",
    )
    for name in [*names, "llm-9"]:
        claim = cluster.rest.get(RESOURCE_CLAIMS, NS, name)
        ref = ClaimRef(NS, claim["metadata"]["uid"], name)
        prepared = preparer.prepare([ref])[ref.uid]
        assert prepared.error == ""
        [r] = results(cluster, name)
        [device] = prepared.devices
        assert device.cdi_device_ids == (cdi.device_id(ref.uid, r["device"], r["shareID"]),)


def test_under_a_share_count_a_gpu_takes_no_more_shares_than_it_publishes(tmp_path: pathlib.Path) -> None:
    # `--consumable-shares=4`: each share takes one of four, whatever little memory it asks for
    with FakeCluster(nodes=1, share_mode=ShareMode("count", 4)) as cluster:
        cluster.queue("root")
        cluster.queue("serving", parent="root", gpu_quota=2)
        names = [f"small-{i}" for i in range(5)]
        for name in names[:4]:
            share_pod(cluster, name, memory="1Gi")
        cluster.arbiter()
        wait_for(lambda: bound(cluster, names[:4]), timeout=60, what="four share pods bound")
        first = {r["device"] for name in names[:4] for r in results(cluster, name)}
        assert len(first) == 1
        assert [r["consumedCapacity"] for r in results(cluster, "small-0")] == [{"memory": "1Gi", "shares": "1"}]
        share_pod(cluster, names[4], memory="1Gi")  # the node counts the four allocated as a full GPU
        wait_for(lambda: bound(cluster, names[4:]), timeout=60, what="the fifth share pod bound")
        assert {r["device"] for r in results(cluster, names[4])}.isdisjoint(first)
