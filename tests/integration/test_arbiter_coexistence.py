"""The arbiter beside kube-scheduler (issue 18): no device is ever in two claims, whatever the interleaving.

On the API fake (its kube-scheduler stand-in allocates and binds, honouring DeviceTaintRules as kube-scheduler
does) and on the real control plane (marker controlplane): arbiter gangs and ordinary DRA pods interleaved,
some ordinary pods created before the arbiter starts. `make coexistence` repeats the full-size run on the real
control plane ten times (tests/bench/test_bench_coexistence.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from agent.arbiter.controller import ArbiterConfig
from agent.arbiter.metrics import DOUBLE_ALLOCATED, ArbiterMetrics
from agent.kube.rest import DEVICE_TAINT_RULES, RESOURCE_CLAIMS
from agent.names import FENCE_RULE, FENCE_TAINT
from fakes.cluster import DRIVER, FakeCluster, wait_for
from tests.integration import coexistence
from tests.integration.conftest import world_on_control_plane

EVENTS_PATH = "/api/v1/namespaces/{ns}/events"


def test_no_device_is_in_two_claims_beside_kube_scheduler_on_the_fake() -> None:
    with FakeCluster(nodes=4) as cluster:
        out = coexistence.run(cluster, gang_pods=80, plain_pods=80, before=16, timeout_s=240)
    print("\n" + out.summary())
    assert out.collisions == {}
    assert out.left == []
    assert out.done_plain == 80  # the ordinary pods were caught (the fence keeps the binder off the devices)


def test_the_arbiter_puts_its_fence_back() -> None:
    with FakeCluster(nodes=1) as cluster:
        cluster.arbiter(ArbiterConfig(period_s=0.05))
        rule = wait_for(lambda: _get(cluster, DEVICE_TAINT_RULES, FENCE_RULE), what="the fence rule")
        assert rule["spec"] == {
            "deviceSelector": {"driver": DRIVER},
            "taint": {"key": FENCE_TAINT, "effect": "NoSchedule", "timeAdded": rule["spec"]["taint"]["timeAdded"]},
        }
        cluster.rest.delete(DEVICE_TAINT_RULES, None, FENCE_RULE)
        wait_for(lambda: _get(cluster, DEVICE_TAINT_RULES, FENCE_RULE), timeout=30, what="the rule put back")


def test_the_arbiter_creates_its_default_queue_when_missing() -> None:
    """Tried: the overlay shipped the Queue beside the CRD, and a first `kubectl apply -R` failed on it (the kind
    is not served when kubectl maps it). The arbiter creates it instead; one an operator changed is kept."""
    from agent.kube.rest import QUEUES

    with FakeCluster(nodes=1) as cluster:
        assert _get(cluster, QUEUES, "default") is None
        cluster.arbiter(ArbiterConfig(period_s=0.05))
        queue = wait_for(lambda: _get(cluster, QUEUES, "default"), what="the default Queue")
        assert queue["spec"]["resources"]["gpu"] == {"quota": 0, "limit": -1, "overQuotaWeight": 1}
        queue["spec"]["priority"] = 7  # an operator's change
        cluster.rest.replace(QUEUES, queue)
        time.sleep(0.5)
        assert (_get(cluster, QUEUES, "default") or {})["spec"].get("priority") == 7


def _get(cluster: FakeCluster, resource: Any, name: str, ns: str | None = None) -> dict[str, Any] | None:
    try:
        return cluster.rest.get(resource, ns, name)
    except Exception:
        return None


def _allocated_claim(cluster: FakeCluster, ns: str, name: str, node: str, device: str) -> dict[str, Any]:
    cluster.namespace(ns)
    claim = cluster.rest.create(
        RESOURCE_CLAIMS,
        ns,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        },
    )
    claim["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": device}]},
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            },
        }
    }
    return cluster.rest.replace(RESOURCE_CLAIMS, claim, "status")


def test_a_device_in_two_claims_is_reported_and_the_rest_is_still_admitted() -> None:
    """Two claims written by hand hold gpu-0 of gpu-node-0: the cycle goes on, an 8-GPU gang goes to the
    other node, each claim gets a Warning Event naming the other, the metric says 1."""
    with FakeCluster(nodes=2) as cluster:
        cluster.queue("team", gpu_quota=16)
        _allocated_claim(cluster, "hand", "first", "gpu-node-0", "gpu-0")
        _allocated_claim(cluster, "hand", "second", "gpu-node-0", "gpu-0")
        registry = CollectorRegistry()
        arbiter = cluster.arbiter(ArbiterConfig(period_s=0.05))
        arbiter.metrics = ArbiterMetrics(registry)
        cluster.gang("team", "big", "team", pods=1, gpus=8)
        pod = wait_for(
            lambda: next((p for p in cluster.pods("team") if not p["spec"].get("schedulingGates")), None),
            timeout=60,
            what="the gang admitted",
        )
        assert "gpu-node-1" in str(pod["spec"]["affinity"])
        arbiter.flush_events()
        events = cluster.rest._request("GET", EVENTS_PATH.format(ns="hand"))["items"]
        told = {(e["involvedObject"]["name"], e["type"]) for e in events if e["reason"] == "DeviceInTwoClaims"}
        assert told == {("first", "Warning"), ("second", "Warning")}
        assert registry.get_sample_value(DOUBLE_ALLOCATED) == 1


# -- the real control plane ---------------------------------------------------------------------------------


@pytest.fixture
def real_site(control_plane: Any) -> Iterator[tuple[Any, FakeCluster]]:
    namespaces = ["plain", *(f"ns-q{q}" for q in range(4))]
    with world_on_control_plane(control_plane, nodes=16, namespaces=namespaces, name="coexistence") as cluster:
        yield control_plane, cluster


@pytest.mark.controlplane
@pytest.mark.timeout(900)
def test_no_device_is_in_two_claims_beside_kube_scheduler(real_site: tuple[Any, FakeCluster]) -> None:
    _, cluster = real_site
    out = coexistence.run(cluster, gang_pods=200, plain_pods=200, before=40, timeout_s=600)
    print("\n" + out.summary())
    assert out.collisions == {}
    assert out.left == []


def test_a_gang_is_told_on_its_podgroup_once_not_on_every_pod() -> None:
    """Writes per admitted pod (issue 18): the admission of a 4-pod gang is one Event on its PodGroup."""
    with FakeCluster(nodes=1) as cluster:
        cluster.queue("team", gpu_quota=8)
        cluster.gang("team", "four", "team", pods=4, gpus=1)
        arbiter = cluster.arbiter(ArbiterConfig(period_s=0.05))

        def admitted() -> list[tuple[str, str]]:
            arbiter.flush_events()
            events = cluster.rest._request("GET", EVENTS_PATH.format(ns="team"))["items"]
            return [
                (e["involvedObject"]["kind"], e["involvedObject"]["name"]) for e in events if e["reason"] == "Admitted"
            ]

        wait_for(
            lambda: all(not p["spec"].get("schedulingGates") for p in cluster.pods("team")),
            timeout=60,
            what="the gang admitted",
        )
        # the pods are ungated inside the commit and the Event is recorded right after it: wait for the Event,
        # then make sure it is the only one
        wait_for(admitted, timeout=30, what="an Admitted Event")
        time.sleep(0.5)
        assert admitted() == [("PodGroup", "four")]
