"""The demo's multi-node NVLink scene: a ComputeDomain forms across four nodes of a fake GB200 NVL72 rack.

Five nodes of the rack (fakes.computedomains: the compute-domain plugin of each node agent, the ComputeDomain
controller, kube-scheduler's and kube-controller-manager's stand-ins); a domain of 4 nodes and four workers of
4 GPUs and one IMEX channel each; what each node's IMEX daemon (the fake nvidia-imex) loaded and status.nodes;
then the job and the domain deleted, and nothing left on the nodes.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agent.kube.rest import PODS
from fakes.computedomains import NvlRack
from fakes.computedomains import wait_for as _wait

NS = "mnnvl"


def run_compute_domain_scene(say: Callable[..., None]) -> None:
    with tempfile.TemporaryDirectory(prefix="nvl-", dir="/tmp") as root, NvlRack(Path(root), nodes=5) as rack:
        t0 = time.monotonic()
        say("  rack       gb200-nvl72-node00..04: 4 GB200 each, one NVLink clique; addresses 127.0.0.1-5")
        rack.apply(
            [
                {
                    "apiVersion": "resource.nvidia.com/v1beta1",
                    "kind": "ComputeDomain",
                    "metadata": {"name": "train"},
                    "spec": {"numNodes": 4, "channel": {"resourceClaimTemplate": {"name": "train-channel"}}},
                }
            ],
            NS,
        )
        rack.wait_for(lambda: _exists(rack, "train-channel"), what="the channel template")
        say("  domain     train (numNodes 4): the controller made ResourceClaimTemplate train-channel")
        rack.apply(
            [
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": f"train-{i}"},
                    "spec": {
                        "containers": [
                            {
                                "name": "main",
                                "image": "trainer:1",
                                "resources": {"limits": {"nvidia.com/gpu": "4"}, "claims": [{"name": "channel"}]},
                            }
                        ],
                        "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": "train-channel"}],
                    },
                }
                for i in range(4)
            ],
            NS,
        )
        rack.wait_for(
            lambda: all(_running(rack, f"train-{i}") for i in range(4)),
            timeout=90,
            what="the workers' channels to be prepared",
        )
        domain = rack.wait_for(
            lambda: _status(rack) == "Ready" and rack.domain(NS, "train"), timeout=30, what="the domain to be Ready"
        )
        uid = domain["metadata"]["uid"]
        members = {entry["name"] for entry in domain["status"]["nodes"]}
        # Ready needs each daemon ready, not each daemon's peers: a node that joined early learns of the later
        # ones when its agent next rewrites the nodes file and signals the daemon to reload it
        rack.wait_for(
            lambda: all(len(n.daemon_nodes().get(uid, [])) == 4 for n in rack.nodes if n.name in members),
            timeout=30,
            what="every IMEX daemon to load its four peers",
        )
        say(
            f"  workers    train-0..3, 4 GPUs and channel0 each: prepared, the domain Ready, every daemon told its "
            f"peers, after {time.monotonic() - t0:.1f}s"
        )
        for entry in sorted(domain["status"]["nodes"], key=lambda e: e["index"]):
            node = next(n for n in rack.nodes if n.name == entry["name"])
            peers = ", ".join(node.daemon_nodes().get(uid, []))
            say(
                f"  {entry['name']}  {entry['ipAddress']}  index {entry['index']}  {entry['status']:8}  "
                f"nvidia-imex peers: {peers}  channels: {', '.join(node.channel_nodes())}"
            )
        for i in range(4):
            rack.rest.delete(PODS, NS, f"train-{i}")
        _wait(
            lambda: all(not n.channel_nodes() and not n.daemon_nodes() for n in rack.nodes),
            timeout=60,
            what="the daemons and channels to go",
        )
        say("  deleted    the workers: every IMEX daemon stopped, every channel node and CDI spec removed")


def _exists(rack: NvlRack, name: str) -> bool:
    from agent.kube.errors import NotFound
    from agent.kube.rest import RESOURCE_CLAIM_TEMPLATES

    try:
        rack.rest.get(RESOURCE_CLAIM_TEMPLATES, NS, name)
    except NotFound:
        return False
    return True


def _running(rack: NvlRack, name: str) -> bool:
    return (rack.rest.get(PODS, NS, name).get("status") or {}).get("phase") == "Running"


def _status(rack: NvlRack) -> str:
    return str((rack.domain(NS, "train").get("status") or {}).get("status"))
