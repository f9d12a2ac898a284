"""The arbiter places a pod only where kube-scheduler will then bind it: the pod's nodeSelector, required node
affinity and tolerations against the nodes' labels and taints, and what it asks for (an extended resource)
against what the nodes have left. The arbiter narrows an admitted pod's affinity to the node it picked, so a node
kube-scheduler refuses would leave the pod pending for good, its GPUs allocated. On the API fake (its
kube-scheduler stand-in filters as kube-scheduler does) and on the real control plane, where kube-scheduler
1.37.2 binds. A rule the arbiter does not read (pod anti-affinity) is reported on the pod in kube-scheduler's
words (real control plane only: the stand-in does not model it)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.arbiter.controller import ArbiterConfig
from agent.kube.rest import NODES, PODS, STRATEGIC_MERGE_PATCH
from agent.names import GATE
from fakes.cluster import FakeCluster, wait_for
from tests.integration.conftest import FAKE_AND_REAL, fake_or_real_world, world_on_control_plane

NS = "team"
DEDICATED = {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}


@pytest.fixture(params=FAKE_AND_REAL)
def cluster(request: pytest.FixtureRequest) -> Iterator[FakeCluster]:
    yield from fake_or_real_world(request, nodes=2, namespaces=[NS])


def test_pods_are_admitted_only_to_nodes_kube_scheduler_binds_them_to(cluster: FakeCluster) -> None:
    # gpu-node-0, first by name and so the arbiter's pick for an empty cluster, is tainted for inference
    tainted, plain = sorted(cluster.agents)
    cluster.rest.patch(
        NODES,
        None,
        tainted,
        {"metadata": {"labels": {"zone": "a"}}, "spec": {"taints": [DEDICATED]}},
        content_type=STRATEGIC_MERGE_PATCH,
    )
    cluster.rest.patch(NODES, None, plain, {"metadata": {"labels": {"zone": "b"}}}, content_type=STRATEGIC_MERGE_PATCH)
    cluster.queue(NS, gpu_quota=16)
    cluster.gang(NS, "training", NS, pods=2, gpus=1)  # tolerates nothing: only the untainted node
    cluster.pod(
        NS,
        "inference",
        NS,
        1,
        spec_extra={  # zone a, and tolerating its taint: only the tainted node
            "nodeSelector": {"zone": "a"},
            "tolerations": [{"key": "dedicated", "operator": "Exists"}],
        },
    )
    cluster.pod(NS, "nowhere", NS, 1, spec_extra={"nodeSelector": {"zone": "c"}})  # no node has zone c
    # claims made first: a cycle before that tells "waiting for the ResourceClaims" too, before the node reason
    wait_for(
        lambda: all((p.get("status") or {}).get("resourceClaimStatuses") for p in cluster.pods(NS)),
        timeout=30,
        interval=0.05,
        what="the pods' claims made from their templates",
    )
    arbiter = cluster.arbiter(ArbiterConfig(period_s=0.05))

    def bound() -> dict[str, str] | None:
        nodes = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in cluster.pods(NS)}
        return nodes if all(n for name, n in nodes.items() if name != "nowhere") else None

    where = wait_for(bound, timeout=120, interval=0.2, what="every pod some node allows bound by kube-scheduler")
    assert where == {"training-0": plain, "training-1": plain, "inference": tainted, "nowhere": None}
    nowhere = next(p for p in cluster.pods(NS) if p["metadata"]["name"] == "nowhere")
    assert nowhere["spec"].get("schedulingGates")  # still waiting for the arbiter, its claim allocated to no one

    def told() -> list[str]:
        arbiter.flush_events()
        events = cluster.rest._request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
        return [e["message"] for e in events if e["involvedObject"]["name"] == "nowhere" and e["reason"] == "Waiting"]

    assert wait_for(told, timeout=30, what="why it waits, told") == [
        "no node may run nowhere: 0/2 nodes are available: 2 node(s) didn't match Pod's node affinity/selector."
    ]


def test_a_pod_asking_an_extended_resource_goes_where_a_node_has_it(cluster: FakeCluster) -> None:
    # gpu-node-1 alone has the fabric, room for one pod of it; gpu-node-0, first by name, has none
    _, second = sorted(cluster.agents)
    cluster.rest.patch(
        NODES,
        None,
        second,
        {"status": {"capacity": {"example.com/ib": "1"}, "allocatable": {"example.com/ib": "1"}}},
        content_type=STRATEGIC_MERGE_PATCH,
        subresource="status",
    )
    cluster.queue(NS, gpu_quota=16)
    for name in ("fabric-0", "fabric-1"):
        cluster.pod(
            NS,
            name,
            NS,
            1,
            spec_extra={
                "containers": [
                    {
                        "name": "main",
                        "image": "trainer:1",
                        "resources": {
                            "requests": {"cpu": "4", "memory": "16Gi", "example.com/ib": "1"},
                            "limits": {"example.com/ib": "1"},
                            "claims": [{"name": "gpus"}],
                        },
                    }
                ]
            },
        )
    cluster.arbiter(ArbiterConfig(period_s=0.05))

    def bound() -> list[tuple[str, str]] | None:
        nodes = sorted((p["metadata"]["name"], p["spec"].get("nodeName")) for p in cluster.pods(NS))
        return [(name, node) for name, node in nodes if node] or None

    (placed,) = wait_for(bound, timeout=120, interval=0.2, what="a fabric pod bound by kube-scheduler")
    assert placed[1] == second
    time.sleep(1)  # the other waits: no node has the fabric left
    assert len(bound() or ()) == 1
    waiting = [p for p in cluster.pods(NS) if p["metadata"]["name"] != placed[0]]
    assert [p["spec"].get("schedulingGates") for p in waiting] == [[{"name": GATE}]]


@pytest.mark.controlplane
@pytest.mark.timeout(300)
def test_an_admitted_pod_kube_scheduler_will_not_bind_is_reported_in_its_words(control_plane: Any) -> None:
    # a rule the arbiter does not read (pod anti-affinity): it admits the pod to the only node, kube-scheduler
    # 1.37.2 refuses to bind it there, and the arbiter says so on the pod instead of leaving it silently pending
    with world_on_control_plane(control_plane, nodes=1, namespaces=[NS], name="unbindable") as cluster:
        (node,) = cluster.agents
        cluster.rest.patch(
            NODES,
            None,
            node,
            {"metadata": {"labels": {"kubernetes.io/hostname": node}}},
            content_type=STRATEGIC_MERGE_PATCH,
        )
        cluster.namespace(NS)
        cluster.rest.create(
            PODS,
            NS,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "web", "namespace": NS, "labels": {"app": "web"}},
                "spec": {"containers": [{"name": "main", "image": "web:1"}]},
            },
        )
        wait_for(
            lambda: cluster.rest.get(PODS, NS, "web")["spec"].get("nodeName"),
            timeout=60,
            what="the web pod bound by kube-scheduler",
        )
        cluster.queue(NS, gpu_quota=8)
        cluster.pod(
            NS,
            "apart",
            NS,
            1,
            spec_extra={
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            {"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": "kubernetes.io/hostname"}
                        ]
                    }
                }
            },
        )
        arbiter = cluster.arbiter(ArbiterConfig(period_s=0.05, unbindable_after_s=0))

        def told() -> list[str]:
            arbiter.flush_events()
            events = cluster.rest._request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
            return [
                e["message"] for e in events if e["involvedObject"]["name"] == "apart" and e["reason"] == "Unbindable"
            ]

        (message,) = wait_for(told, timeout=120, interval=0.2, what="the refusal told")
        assert message.startswith(f"kube-scheduler does not bind this pod to {node}, where the arbiter admitted it")
        assert "didn't match pod anti-affinity rules" in message
        assert not cluster.rest.get(PODS, NS, "apart")["spec"].get("nodeName")
