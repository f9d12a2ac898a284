"""The 4-node ComputeDomain job of 16 GPUs on the real control plane (kube-apiserver, kube-scheduler and
kube-controller-manager 1.37): the real scheduler allocates each pod's 4 GPUs and its channel from the nodes'
slices, the real claim controller makes the claims, the real garbage collector follows ownerReferences; the
ComputeDomain controller and five nodes' compute-domain plugins are ours, the kubelets the rack's stand-ins."""

from __future__ import annotations

from typing import Any

import pytest

from agent.computedomain.model import READY
from agent.kube.errors import NotFound
from agent.kube.rest import COMPUTE_DOMAINS, PODS, RESOURCE_CLAIM_TEMPLATES
from fakes.computedomains import NvlRack
from tests.controlplane.cluster import reset
from tests.integration.test_compute_domains import domain_doc
from tests.integration.test_node_support import short_tmpdir

NS = "mnnvl"


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {"name": "main", "image": "trainer:1", "resources": {"claims": [{"name": "gpus"}, {"name": "channel"}]}}
            ],
            "resourceClaims": [
                {"name": "gpus", "resourceClaimTemplateName": "four-gpus"},
                {"name": "channel", "resourceClaimTemplateName": "train-channel"},
            ],
        },
    }


FOUR_GPUS = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaimTemplate",
    "metadata": {"name": "four-gpus"},
    "spec": {
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": 4},
                    }
                ]
            }
        }
    },
}


def _gone(rest: Any, resource: Any, name: str) -> bool:
    try:
        rest.get(resource, NS, name)
    except NotFound:
        return True
    return False


@pytest.mark.controlplane
@pytest.mark.timeout(300)
def test_a_four_node_domain_job_runs_on_the_real_control_plane(control_plane: Any) -> None:
    reset(control_plane)
    with short_tmpdir("nvlr-") as root:
        kubeconfig = control_plane.write_kubeconfig(root / "kubeconfig")
        with NvlRack(
            root,
            nodes=5,
            kubeconfig=kubeconfig,
            make_node=lambda name: control_plane.add_node(name, {"kubernetes.io/hostname": name}),
        ) as rack:
            rest = rack.rest
            rack.apply([domain_doc("train", 4, "train-channel"), FOUR_GPUS], NS)
            rack.wait_for(lambda: not _gone(rest, RESOURCE_CLAIM_TEMPLATES, "train-channel"), what="the template")
            rack.apply([pod(f"train-{i}") for i in range(4)], NS)
            rack.wait_for(
                lambda: all(
                    (rest.get(PODS, NS, f"train-{i}").get("status") or {}).get("phase") == "Running" for i in range(4)
                ),
                timeout=120,
                what="the workers to start",
            )
            nodes = [rack.pod_node(NS, f"train-{i}") for i in range(4)]
            assert len({n.name for n in nodes if n}) == 4
            uid = rack.domain(NS, "train")["metadata"]["uid"]
            addresses = sorted(n.address for n in nodes if n)
            for node in nodes:
                assert node is not None and node.channel_nodes() == ["channel0"]
                rack.wait_for(
                    lambda node=node: sorted(node.daemon_nodes().get(uid, [])) == addresses,
                    timeout=30,
                    what=f"{node.name}'s daemon to load the four peers",
                )
            rack.wait_for(
                lambda: (rack.domain(NS, "train").get("status") or {}).get("status") == READY,
                timeout=30,
                what="the domain to be Ready",
            )
            for i in range(4):
                rest.delete(PODS, NS, f"train-{i}")
            rack.wait_for(
                lambda: all(not n.channel_nodes() and not n.cdi_specs() and not n.daemon_nodes() for n in rack.nodes),
                timeout=60,
                what="channels and daemons to go",
            )
            rest.delete(COMPUTE_DOMAINS, NS, "train")
            rack.wait_for(
                lambda: (
                    _gone(rest, COMPUTE_DOMAINS, "train") and _gone(rest, RESOURCE_CLAIM_TEMPLATES, "train-channel")
                ),
                timeout=60,
                what="the domain and its template to go",
            )
    reset(control_plane)
