"""A claim a node refuses as written is the claim's error (issue 33, item 6): told once, on the claim and on
its pod in the claim's words, and not tried again until the claim changes.

Tried: a pod whose claim has a selector that fails on every device (a division by zero, which the API server
admits: it fails only when run), against the API fake and a node agent serving reservations. Before, the
arbiter sent a Reserve every cycle (26 in 30 s in the issue's probe) and told the pod "NodeUnavailable:
INVALID_ARGUMENT ...", blaming the node."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.arbiter.controller import ArbiterConfig
from agent.kube.rest import EVENTS, RESOURCE_CLAIMS
from agent.names import GATE
from agent.reservation.protocol import NodeAllocatorService
from fakes.cluster import FakeCluster, wait_for

pytestmark = pytest.mark.slow
NS = "team-a"
FAILS = "device.driver.size() / 0 == 1"  # a runtime error on every device


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(nodes=1) as c:
        c.queue("root")
        c.queue("team-a", parent="root", gpu_quota=8)
        yield c


def claim(cluster: FakeCluster, selector: str) -> dict[str, Any]:
    cluster.namespace(NS)
    return cluster.rest.create(
        RESOURCE_CLAIMS,
        NS,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "picky", "namespace": NS},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu.nvidia.com",
                                "count": 1,
                                "selectors": [{"cel": {"expression": selector}}],
                            },
                        }
                    ]
                }
            },
        },
    )


def reserves(calls: list[str]) -> int:
    return sum(1 for member in calls if member.endswith("/picky"))


def events(cluster: FakeCluster, kind: str) -> list[dict[str, Any]]:
    return [e for e in cluster.rest.list(EVENTS, NS)["items"] if e["involvedObject"]["kind"] == kind]


def test_a_claim_a_node_refuses_waits_told_once_until_it_changes(
    cluster: FakeCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = NodeAllocatorService.reserve

    def counted(self: NodeAllocatorService, bearer: str | None, gang_id: str, member: str, *rest: Any) -> Any:
        calls.append(member)
        return real(self, bearer, gang_id, member, *rest)

    real_many = NodeAllocatorService.reserve_many

    def counted_many(self: NodeAllocatorService, bearer: str | None, gang_id: str, members: Any, *rest: Any) -> Any:
        calls.extend(member for member, _ in members)  # one call a node: each member counted as a Reserve
        return real_many(self, bearer, gang_id, members, *rest)

    monkeypatch.setattr(NodeAllocatorService, "reserve", counted)
    monkeypatch.setattr(NodeAllocatorService, "reserve_many", counted_many)
    claim(cluster, FAILS)
    cluster.pod(
        NS, "trainer", "team-a", 1, spec_extra={"resourceClaims": [{"name": "gpus", "resourceClaimName": "picky"}]}
    )
    arbiter = cluster.arbiter(ArbiterConfig(period_s=0.1, cycle_gap_s=0.1))
    wait_for(lambda: reserves(calls) >= 1, timeout=30, what="a first Reserve")
    looked = arbiter.cycles + arbiter.skipped_looks  # a look with nothing changed starts no cycle
    wait_for(lambda: arbiter.cycles + arbiter.skipped_looks >= looked + 10, timeout=30, what="ten more looks")
    assert reserves(calls) == 1  # the claim is the problem: trying it again cannot help

    assert arbiter.flush_events()
    on_claim = events(cluster, "ResourceClaim")
    assert [(e["reason"], e["type"], e["count"]) for e in on_claim] == [("InvalidClaim", "Warning", 1)]
    assert "division by zero" in on_claim[0]["message"].lower() or "failed" in on_claim[0]["message"]
    on_pod = [e for e in events(cluster, "Pod") if e["involvedObject"]["name"] == "trainer"]
    assert len(on_pod) == 1, on_pod  # one Event on the pod, in the claim's words, blaming no node
    assert on_pod[0]["type"] == "Warning" and on_pod[0]["message"].startswith(
        "ResourceClaim picky of trainer was refused as written: "
    )
    assert "NodeUnavailable" not in on_pod[0]["message"] and "INVALID_ARGUMENT" not in on_pod[0]["message"]

    # a change to the claim (any: a label) is tried again, once
    changed = cluster.rest.get(RESOURCE_CLAIMS, NS, "picky")
    changed["metadata"]["labels"] = {"tried": "again"}
    cluster.rest.replace(RESOURCE_CLAIMS, changed)
    wait_for(lambda: reserves(calls) == 2, timeout=30, what="a Reserve of the changed claim")
    time.sleep(1.0)
    assert reserves(calls) == 2

    # claims cannot be edited in place: the fixed claim is a new one, and the pod is admitted with it
    cluster.rest.delete(RESOURCE_CLAIMS, NS, "picky")
    wait_for(
        lambda: not [c for c in cluster.rest.list(RESOURCE_CLAIMS, NS)["items"] if c["metadata"]["name"] == "picky"],
        what="the claim deleted",
    )
    claim(cluster, 'device.driver == "gpu.nvidia.com"')
    pod = wait_for(
        lambda: next(
            (p for p in cluster.pods(NS) if not any(g["name"] == GATE for g in p["spec"].get("schedulingGates") or ())),
            None,
        ),
        timeout=30,
        what="the pod admitted with the fixed claim",
    )
    assert pod["metadata"]["name"] == "trainer"
