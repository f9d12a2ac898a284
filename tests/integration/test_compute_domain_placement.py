"""The arbiter places a gang whose pods share a ComputeDomain inside one NVLink clique (issue 36, item 4), on
the API fake: GB200 NVL72 nodes of 4 GPUs (the fake NVML's `gb200-nvl72-node00` profile) whose agents serve
reservations and publish their GPUs, and the IMEX channels their compute-domain plugin publishes in two cliques
(agent.computedomain.channels.resource_slice, with each node's clique). kube-scheduler's stand-in allocates the
channel claims on the nodes the arbiter picked."""

from __future__ import annotations

import contextlib
import pathlib

import yaml

from agent.computedomain import channels, templates
from agent.computedomain.model import ComputeDomain
from agent.kube.errors import Conflict
from agent.kube.rest import NODES, POD_GROUPS, PODS, RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS, RESOURCE_SLICES
from agent.names import GATE, QUEUE_LABEL
from fakes.cluster import DEVICE_CLASSES, FakeCluster, wait_for

NS = "mnnvl"
OVERLAY = pathlib.Path(__file__).resolve().parents[2] / "daemonset" / "overlays" / "compute-domains"


def nvl_cluster(cliques: dict[str, int]) -> FakeCluster:
    """Nodes `<clique>-<i>` of 4 GPUs each, every one publishing its IMEX channel in its clique."""
    cluster = FakeCluster(nodes=0, machine="gb200-nvl72-node00")
    for klass in yaml.safe_load_all((OVERLAY / "deviceclasses.yaml").read_text()):
        with contextlib.suppress(Conflict):
            cluster.rest.create(DEVICE_CLASSES, None, klass)
    for clique, count in cliques.items():
        for i in range(count):
            name = f"{clique}-{i}"
            cluster.add_node(name)
            uid = cluster.rest.get(NODES, None, name)["metadata"]["uid"]  # the plugin's slice is the Node's
            cluster.rest.create(RESOURCE_SLICES, None, channels.resource_slice(name, uid, 0, f"cluster-uuid.{clique}"))
    cluster.queue("mnnvl", gpu_quota=0)
    cluster.namespace(NS)
    domain = ComputeDomain(
        namespace=NS,
        name="train",
        uid="domain-uid",
        num_nodes=4,
        template_name="train-channel",
        allocation_mode="Single",
    )
    cluster.rest.create(RESOURCE_CLAIM_TEMPLATES, NS, templates.channel_template(domain))
    return cluster


def domain_gang(cluster: FakeCluster, name: str, pods: int) -> None:
    """A PodGroup of `pods` workers, each with 4 GPUs and the domain's channel, gated for the arbiter."""
    gpus = cluster.template(NS, 4)
    cluster.rest.create(
        POD_GROUPS,
        NS,
        {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": name, "namespace": NS, "labels": {QUEUE_LABEL: "mnnvl"}},
            "spec": {"schedulingPolicy": {"gang": {"minCount": pods}}},
        },
    )
    for i in range(pods):
        cluster.rest.create(
            PODS,
            NS,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{name}-{i}", "namespace": NS, "labels": {QUEUE_LABEL: "mnnvl"}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": "trainer:1",
                            "resources": {
                                "requests": {"cpu": "4", "memory": "16Gi"},
                                "claims": [{"name": "gpus"}, {"name": "channel"}],
                            },
                        }
                    ],
                    "resourceClaims": [
                        {"name": "gpus", "resourceClaimTemplateName": gpus},
                        {"name": "channel", "resourceClaimTemplateName": "train-channel"},
                    ],
                    "schedulingGates": [{"name": GATE}],
                    "schedulingGroup": {"podGroupName": name},
                    "terminationGracePeriodSeconds": 0,
                },
            },
        )
    wait_for(lambda: len(_claims(cluster)) == 2 * pods, what="the claims generated from the templates")


def _claims(cluster: FakeCluster) -> list[dict]:
    return cluster.rest.list(RESOURCE_CLAIMS, NS)["items"]


def _nodes(cluster: FakeCluster, prefix: str) -> dict[str, str | None]:
    return {
        p["metadata"]["name"]: p["spec"].get("nodeName")
        for p in cluster.pods(NS)
        if p["metadata"]["name"].startswith(prefix)
    }


def test_a_domain_gang_is_placed_inside_one_clique_and_its_channels_there() -> None:
    # clique a: 3 nodes, b: 4: sixteen GPUs in four pods fit b alone (and a with b, which must not be taken)
    with nvl_cluster({"a": 3, "b": 4}) as cluster:
        domain_gang(cluster, "train", 4)
        cluster.arbiter()
        wait_for(lambda: all(_nodes(cluster, "train").values()), timeout=60, what="the gang bound")
        assert sorted(n or "" for n in _nodes(cluster, "train").values()) == ["b-0", "b-1", "b-2", "b-3"]

        def channel_nodes() -> list[str]:
            return sorted(
                r["pool"]
                for c in _claims(cluster)
                for r in ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
                if r["driver"] == "compute-domain.nvidia.com"
            )

        wait_for(lambda: len(channel_nodes()) == 4, timeout=30, what="the channels allocated")
        assert channel_nodes() == ["b-0", "b-1", "b-2", "b-3"]  # one channel a node, by kube-scheduler


def test_a_domain_gang_that_fits_no_clique_waits_and_says_why() -> None:
    with nvl_cluster({"a": 3, "b": 3}) as cluster:
        domain_gang(cluster, "train", 4)
        arbiter = cluster.arbiter(start=False)
        for _ in range(3):  # tried: 24 GPUs in all, 12 in each clique, for a 16-GPU gang
            report = arbiter.cycle()
            assert report.admitted == []
        assert report.waiting[f"{NS}/train"] == (  # as kube-scheduler words a pod no node takes
            "no fit in one NVLink clique for the 4 pod(s) of a ComputeDomain needing 16 GPUs: 0/6 nodes are "
            "available: 6 node(s) in a clique too small for the gang's 16 GPUs (the largest has 12)."
        )
        assert all(n is None for n in _nodes(cluster, "train").values())
