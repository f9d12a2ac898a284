"""Prioritized lists (`firstAvailable`) as kube-scheduler's structured allocator takes them: the subrequests in
order, the first that fits wins, and the allocation names it (`request/subrequest`). The arbiter read only the
first entry: a claim `[{count: 9}, {count: 1}]` on 8-GPU nodes waited forever, told "the gang asks for more than
the whole cluster has", and behind the fence kube-scheduler could not take the fallback either (issue 33,
item 2). The same claims, one after another, go first to kube-scheduler (no arbiter, no fence) and then, on the
same empty cluster, to the arbiter: each must get the same subrequest, under the same result name. On the API
fake (its kube-scheduler stand-in allocates prioritized lists) and on the real control plane (kube-scheduler
1.37.2)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from agent.arbiter.controller import ArbiterConfig
from agent.kube.errors import Conflict
from agent.kube.rest import PODS, RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS
from agent.names import GATE, QUEUE_LABEL
from fakes.cluster import FakeCluster, wait_for
from tests.integration import coexistence
from tests.integration.conftest import FAKE_AND_REAL, fake_or_real_world

NS = "prioritized"
# (pod, its template's subrequests as (name, count)), created in this order on two empty 8-GPU nodes
PODS_IN_ORDER = [
    ("p-nine-or-one", [("nine", 9), ("one", 1)]),  # 9 fits no node: the fallback
    ("p-eight-or-one", [("eight", 8), ("one", 1)]),  # 8 fits the node the first pod left empty
    ("p-eight-or-two", [("eight", 8), ("two", 2)]),  # 7 free at most now: the second entry
]


@pytest.fixture(params=FAKE_AND_REAL)
def cluster(request: pytest.FixtureRequest) -> Iterator[FakeCluster]:
    yield from fake_or_real_world(request, nodes=2, namespaces=[NS])


def _template(cluster: FakeCluster, name: str, subrequests: list[tuple[str, int]]) -> None:
    cluster.namespace(NS)
    with contextlib.suppress(Conflict):
        cluster.rest.create(
            RESOURCE_CLAIM_TEMPLATES,
            NS,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": NS},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gpus",
                                    "firstAvailable": [
                                        {
                                            "name": sub,
                                            "deviceClassName": "gpu.nvidia.com",
                                            "allocationMode": "ExactCount",
                                            "count": count,
                                        }
                                        for sub, count in subrequests
                                    ],
                                }
                            ]
                        }
                    }
                },
            },
        )


def _pod(cluster: FakeCluster, name: str, *, arbiter: bool) -> None:
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": "main",
                "image": "trainer:1",
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "claims": [{"name": "gpus"}]},
            }
        ],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": name}],
        "terminationGracePeriodSeconds": 0,
    }
    labels = {}
    if arbiter:
        spec["schedulingGates"] = [{"name": GATE}]
        labels[QUEUE_LABEL] = NS
    cluster.rest.create(
        PODS,
        NS,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": spec,
        },
    )


def _results(cluster: FakeCluster, pod: str) -> list[str] | None:
    """The request names of the allocation of the pod's claim, once the pod is bound."""
    bound = cluster.rest.get(PODS, NS, pod)
    if not bound["spec"].get("nodeName"):
        return None
    for claim in cluster.rest.list(RESOURCE_CLAIMS, NS)["items"]:
        if any(o.get("name") == pod for o in claim["metadata"].get("ownerReferences") or ()):
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
            return sorted(r["request"] for r in results or ()) or None
    return None


def _run(cluster: FakeCluster, *, arbiter: bool) -> dict[str, list[str]]:
    chosen = {}
    for pod, _ in PODS_IN_ORDER:
        _pod(cluster, pod, arbiter=arbiter)
        chosen[pod] = wait_for(
            lambda p=pod: _results(cluster, p), timeout=90, interval=0.2, what=f"{pod} bound with its claim allocated"
        )
    return chosen


def test_the_arbiter_takes_the_subrequest_kube_scheduler_takes(cluster: FakeCluster) -> None:
    for pod, subrequests in PODS_IN_ORDER:
        _template(cluster, pod, subrequests)
    expected = {"p-nine-or-one": ["gpus/one"], "p-eight-or-one": ["gpus/eight"] * 8, "p-eight-or-two": ["gpus/two"] * 2}
    assert _run(cluster, arbiter=False) == expected  # kube-scheduler's own choice

    coexistence.force_delete_pods(cluster.rest, [NS])  # the same empty cluster for the arbiter
    wait_for(
        lambda: (
            not cluster.rest.list(PODS, NS)["items"]
            and not any(
                (c.get("status") or {}).get("allocation") for c in cluster.rest.list(RESOURCE_CLAIMS, NS)["items"]
            )
        ),
        timeout=90,
        what="the pods gone and their claims freed",
    )
    cluster.queue(NS, gpu_quota=16)
    cluster.arbiter(ArbiterConfig(period_s=0.05))
    assert _run(cluster, arbiter=True) == expected
