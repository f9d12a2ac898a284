"""A ComputeDomain job with one worker in a real container: the real node tier (kubelet 1.37, containerd 2.4, runc)
beside three trays of the fake GB200 NVL72 rack (fakes.computedomains: the node agent's compute-domain plugin
with kubelet stand-ins), all four in one fabric clique, on the real control plane.

The real node's agent runs as a host process with `--compute-domains` on the fake NVML machine of tray 3; its
IMEX daemons are the fake driver root's nvidia-imex stand-ins, its channel major comes from the driver root's
/proc/devices stand-in, and the channel device node goes under the node's own dev root. Node addresses are
loopback: the rack's trays 127.0.0.1-3, the real node's IMEX address 127.0.0.4.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from agent.computedomain.model import DRIVER, READY
from fakes.computedomains import NvlRack, channel_nodes, daemon_nodes
from fakes.nvml.binaries import IMEX_CHANNELS_MAJOR, PROC_DEVICES
from tests.conftest import CONTROL_PLANE_KEY, NODE_STACK_KEY, built_binaries
from tests.controlplane.cluster import ControlPlane, wait_for
from tests.integration import test_real_node as real
from tests.integration.test_compute_domains import domain_doc
from tests.integration.test_compute_domains_real import FOUR_GPUS
from tests.integration.test_node_support import short_tmpdir
from tests.node import images
from tests.node.node import RealNode, real_node_lock

pytestmark = [pytest.mark.node, pytest.mark.timeout(420)]

NS = real.NS
RACK_TRAYS = 3  # the rack's trays 0-2; the real node is tray 3
REAL_TRAY = "gb200-nvl72-node03"
REAL_IMEX_ADDRESS = "127.0.0.4"
DOMAINS = f"/apis/resource.nvidia.com/v1beta1/namespaces/{NS}/computedomains"
TEMPLATES = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates"


@dataclass
class Mnnvl:
    cp: ControlPlane
    node: RealNode
    rack: NvlRack

    @property
    def site(self) -> real.Site:
        return real.Site(self.cp, self.node)

    def domain(self, name: str) -> dict[str, Any]:
        return dict(self.cp.request("GET", f"{DOMAINS}/{name}"))


@pytest.fixture(scope="module")
def mnnvl(request: pytest.FixtureRequest) -> Iterator[Mnnvl]:
    binaries = built_binaries(request, CONTROL_PLANE_KEY, "node tier")
    stack = built_binaries(request, NODE_STACK_KEY, "node tier")
    with (
        real_node_lock(),
        short_tmpdir("rnc-") as root,
        ControlPlane(binaries).start() as cp,
        # the rack first: it serves the ComputeDomain CRD and the device classes the real node's agent reads
        NvlRack(
            root / "rack",
            nodes=RACK_TRAYS,
            kubeconfig=cp.write_kubeconfig(root / "rack.kubeconfig"),
            make_node=lambda name: cp.add_node(name, {"kubernetes.io/hostname": name}),
        ) as rack,
    ):
        node_root = root / "node"
        node_root.mkdir()
        agent_args = (
            "--compute-domains",
            "--imex-address",
            REAL_IMEX_ADDRESS,
            "--proc-devices",
            str(node_root / "driver-root" / PROC_DEVICES),  # what RealNode installs its fake driver root at
        )
        with RealNode(cp, stack, node_root, machine=REAL_TRAY, agent_args=agent_args).start() as node:
            assert node.driver_root == node_root / "driver-root"
            yield Mnnvl(cp, node, rack)


def worker(name: str) -> dict[str, Any]:
    """A worker of the job: four GPUs and the domain's channel; runnable on the real node (the local image, host
    network, no token), and as it is on the rack's trays, whose kubelet stand-ins run no containers."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": 5,
            "containers": [
                {
                    "name": "ctr",
                    "image": images.WORKLOAD_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", real.WORKLOAD],
                    "resources": {"claims": [{"name": "gpus"}, {"name": "channel"}]},
                }
            ],
            "resourceClaims": [
                {"name": "gpus", "resourceClaimTemplateName": FOUR_GPUS["metadata"]["name"]},
                {"name": "channel", "resourceClaimTemplateName": "train-channel"},
            ],
        },
    }


def _domain_specs(node: RealNode) -> list[str]:
    """The compute-domain driver's CDI specs on the real node."""
    return sorted(p.name for p in node.cdi_root.iterdir() if DRIVER in p.name)


def test_a_four_node_domain_job_runs_one_worker_in_a_real_container(mnnvl: Mnnvl) -> None:
    """Tried: a 4-node ComputeDomain and its four 4-GPU workers, kube-scheduler placing one on each node (three
    rack trays and the real node). The real node's worker runs in a real container that sees exactly its IMEX
    channel (channel0, the major from /proc/devices), the real node's nvidia-imex config names the four nodes'
    loopback addresses, and status.nodes[] lists the four Ready. Deleting the workers removes the real node's
    channel, its CDI spec and its daemon."""
    cp, node, site = mnnvl.cp, mnnvl.node, mnnvl.site
    cp.request("POST", DOMAINS, domain_doc("train", 4, "train-channel"))
    cp.request("POST", TEMPLATES, FOUR_GPUS)
    wait_for("the domain's channel template", lambda: site.get(f"{TEMPLATES}/train-channel"), 30)
    names = [f"train-{i}" for i in range(4)]
    started = time.monotonic()
    for name in names:
        cp.request("POST", real.PODS, worker(name))

    def real_worker() -> str | None:
        node.check_running()
        return next(
            (n for n in names if (site.get(f"{real.PODS}/{n}") or {}).get("spec", {}).get("nodeName") == node.name),
            None,
        )

    on_node = wait_for("a worker bound to the real node", real_worker, 60)
    pod = real.wait_running(site, on_node)
    running_s = time.monotonic() - started
    wait_for(
        "every worker to run",
        lambda: all((site.get(f"{real.PODS}/{n}") or {}).get("status", {}).get("phase") == "Running" for n in names),
        60,
    )
    all_s = time.monotonic() - started

    # The container sees exactly its channel, a character device of the channels' major.
    assert real.in_container(site, pod, "ls /dev/nvidia-caps-imex-channels").split() == ["channel0"]
    stat = real.in_container(site, pod, "stat -c '%F %t:%T' /dev/nvidia-caps-imex-channels/channel0").strip()
    assert stat == f"character special file {IMEX_CHANNELS_MAJOR:x}:0"
    assert channel_nodes(node.dev_root) == ["channel0"]
    assert len(_domain_specs(node)) == 1
    # The real node's IMEX daemon (the fake nvidia-imex) loaded the four nodes' loopback addresses.
    uid = mnnvl.domain("train")["metadata"]["uid"]
    addresses = sorted([*(n.address for n in mnnvl.rack.nodes), REAL_IMEX_ADDRESS])
    state_dir = node.root / "state"
    try:
        wait_for(
            "the real node's daemon to load the four peers",
            lambda: sorted(daemon_nodes(state_dir).get(uid, [])) == addresses or None,
            30,
        )
    except AssertionError as error:
        files = sorted(str(p.relative_to(state_dir)) for p in (state_dir / "compute-domains").rglob("*"))
        raise AssertionError(
            f"{error}: loaded {daemon_nodes(state_dir)}, files {files}, "
            f"status {mnnvl.domain('train').get('status')}\nagent:\n{node.root / 'agent.log'}: "
            + (node.root / "agent.log").read_text(errors="replace")[-3000:]
        ) from None
    # status.nodes[]: the four nodes, each Ready, the real node at its IMEX address; the domain Ready.
    status = wait_for(
        "the domain to be Ready",
        lambda: (s := mnnvl.domain("train").get("status") or {}).get("status") == READY and s or None,
        30,
    )
    entries = {n["name"]: n for n in status["nodes"]}
    assert set(entries) == {node.name, *(n.name for n in mnnvl.rack.nodes)}
    assert {n["status"] for n in entries.values()} == {READY}
    assert entries[node.name]["ipAddress"] == REAL_IMEX_ADDRESS

    started = time.monotonic()
    for name in names:
        cp.request("DELETE", f"{real.PODS}/{name}")
    wait_for(
        "the real node's channel, CDI spec and daemon to go",
        lambda: not channel_nodes(node.dev_root) and not _domain_specs(node) and not daemon_nodes(state_dir) or None,
        60,
    )
    for name in names:
        wait_for(f"{name} to be gone", lambda name=name: None if site.get(f"{real.PODS}/{name}") else True, 60)
    teardown_s = time.monotonic() - started
    print(
        f"real node's worker Running {running_s:.1f}s after the job was created, all four {all_s:.1f}s; "
        f"teardown (pods gone, channel, spec and daemon removed) {teardown_s:.1f}s"
    )
    assert not [n for n in mnnvl.rack.nodes if n.channel_nodes() or n.daemon_nodes()]
