"""kill -9 of `gpu-dra-agent node --compute-domains` at a random moment of a channel prepare, on a fake GB200 node:
after the restart the agent holds exactly what the checkpoint says was prepared (or nothing), and after the
kubelet's unprepare nothing is left: no channel device node, no CDI spec, no nvidia-imex process, no daemon
directory, no entry in status.nodes.

Each trial draws its kill delay from a seeded random source (the seed is in the failure message). A few trials
run in the regular suite; `-m trials` runs fifty.
"""

from __future__ import annotations

import os
import pathlib
import random
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

import pynvml as N
import pytest

import fakes.apiserver
from agent.claims.checkpoint import read_boot_id
from agent.claims.types import ClaimRef
from agent.computedomain import checkpoint as cd_checkpoint
from agent.computedomain.model import DRIVER
from agent.kube.rest import COMPUTE_DOMAINS, NODES, RESOURCE_CLAIMS, RESOURCE_SLICES, Rest
from fakes.computedomains import CRDS, NAMESPACES, OVERLAY, _documents, wait_for
from fakes.kubelet import FakeKubelet, KubeletError, Retry
from fakes.nvml import persist
from fakes.nvml.control import FakeNvml
from fakes.nvml.machines import NVL72_CLIQUE_ID, NVL72_CLUSTER_UUID, nvl72_node
from tests.integration.test_node_support import Daemon, short_tmpdir

NODE = "gb200-nvl72-node00"
NS = "crash"
CHANNELS = 16  # allocationMode All: every one of them made and injected
MAX_KILL_DELAY_S = 1.2  # a prepare here starts nvidia-imex and asks nvidia-imex-ctl: about a second
REGULAR_TRIALS = 3
T = TypeVar("T")


def _setup(rest: Rest, mode: str) -> ClaimRef:
    for crd in _documents(OVERLAY / "computedomain-crd.yaml"):
        rest.create(CRDS, None, crd)
    wait_for(lambda: _served(rest), timeout=30, what="the CRD")
    rest.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    rest.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    domain = rest.create(
        COMPUTE_DOMAINS,
        NS,
        {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "ComputeDomain",
            "metadata": {"name": "job"},
            "spec": {"numNodes": 1, "channel": {"allocationMode": mode, "resourceClaimTemplate": {"name": "job"}}},
        },
    )
    claim = rest.create(
        RESOURCE_CLAIMS,
        NS,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "job-channel"},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "channel", "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"}}
                    ]
                }
            },
        },
    )
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "channel", "driver": DRIVER, "pool": NODE, "device": "channel-0"}],
                "config": [
                    {
                        "source": "FromClaim",
                        "requests": ["channel"],
                        "opaque": {
                            "driver": DRIVER,
                            "parameters": {
                                "apiVersion": "resource.nvidia.com/v1beta1",
                                "kind": "ComputeDomainChannelConfig",
                                "domainID": domain["metadata"]["uid"],
                                "allocationMode": mode,
                            },
                        },
                    }
                ],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
            },
        }
    }
    rest.replace(RESOURCE_CLAIMS, claim, "status")
    return ClaimRef(NS, claim["metadata"]["uid"], "job-channel")


def _served(rest: Rest) -> bool:
    try:
        rest.list(COMPUTE_DOMAINS)
    except Exception:
        return False
    return True


def imex_processes(root: pathlib.Path) -> list[int]:
    """Live fake nvidia-imex processes whose config is under `root` (the daemons of this test's agent)."""
    found = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(a.endswith(b"/nvidia-imex") for a in argv) and str(root).encode() in b" ".join(argv):
            found.append(int(proc.name))
    return found


def retried(call: Callable[[], T], timeout: float = 30.0) -> T:
    """A call the kubelet makes again until the restarted plugin answers (its pod worker's next sync)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KubeletError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


class Node:
    def __init__(self, root: pathlib.Path, kubeconfig: pathlib.Path, *extra: str) -> None:
        self.root = root
        self.dev_root = root / "dev-root"
        self.agent = Daemon(
            root,
            kubeconfig,
            node=NODE,
            machine=f"fake:{NODE}",
            env={persist.ENV: str(root / "gpus.json")},
            extra_args=(
                "--compute-domains",
                "--imex-address",
                "127.0.0.9",
                "--proc-devices",
                str(root / "driver-root" / "proc" / "devices"),
                "--dev-root",
                str(self.dev_root),
                "--imex-channel-count",
                str(CHANNELS),
                "--no-mig-reconfigure",
                "--no-health-events",
                *extra,
            ),
        )

    def channel_nodes(self) -> list[str]:
        d = self.dev_root / "dev" / "nvidia-caps-imex-channels"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def specs(self) -> list[str]:
        d = self.agent.cdi_root
        return sorted(p.name for p in d.iterdir() if p.name.startswith("k8s.compute-domain")) if d.is_dir() else []

    def daemon_dirs(self) -> list[str]:
        d = self.agent.state_dir / "compute-domains" / "domains"
        return sorted(p.name for p in d.iterdir()) if d.is_dir() else []

    def prepared(self) -> dict[str, str]:
        cp, _ = cd_checkpoint.CheckpointStore(self.agent.state_dir / "compute-domains", read_boot_id()).load()
        return {uid: r.state for uid, r in cp.claims.items()}

    def start(self) -> dict[str, object]:
        """Start the agent; its compute-domain recovery record once the plugin serves."""
        self.agent.start()
        recovery = self.agent.wait_for_log("compute-domain checkpoint ready", timeout=60)
        wait_for(
            lambda: any(
                r.get("msg") == "kubelet plugin serving" and r.get("driver") == DRIVER for r in self.agent.logs()
            ),
            timeout=30,
            what="the compute-domain plugin to serve",
        )
        return recovery


def one_trial(seed: int, mode: str) -> str:
    rng = random.Random(seed)
    with short_tmpdir("cdcrash-") as root, fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        ref = _setup(rest, mode)
        node = Node(root, server.write_kubeconfig(root / "kubeconfig"))
        try:
            return _trial(rng, seed, mode, rest, ref, node, root)
        finally:  # a failed trial leaves no agent or daemon running
            node.agent.close()
            for pid in imex_processes(root):
                os.kill(pid, signal.SIGKILL)


def _trial(rng: random.Random, seed: int, mode: str, rest: Rest, ref: ClaimRef, node: Node, root: pathlib.Path) -> str:
    with FakeKubelet(node.agent.kubelet_root, retry=Retry(attempts=1), timeout=30) as kubelet:
        node.start()
        kubelet.wait_for_driver(DRIVER, timeout=30)
        answer: dict[str, object] = {}

        def prepare() -> None:
            try:
                answer["result"] = kubelet.prepare(DRIVER, [ref])[ref.uid]
            except KubeletError as exc:
                answer["error"] = exc

        call = threading.Thread(target=prepare)
        delay = rng.uniform(0, MAX_KILL_DELAY_S)
        call.start()
        time.sleep(delay)
        node.agent.kill()
        call.join(timeout=60)
        why = f"seed {seed} ({mode}, kill after {delay:.2f}s)"

        recovery = node.start()  # the restarted agent repairs what the kill left
        state = node.prepared()
        assert state in ({}, {ref.uid: cd_checkpoint.COMPLETED}), f"{why}: checkpoint {state}"
        if state:  # prepared before the kill: all of it is there, its daemon running again
            want = ["channel0"] if mode == "Single" else sorted(f"channel{i}" for i in range(CHANNELS))
            assert node.channel_nodes() == want, why
            assert len(node.specs()) == 1, why
            wait_for(lambda: len(imex_processes(root)) == 1, timeout=30, what=f"{why}: its daemon again")
        else:
            leaked = f"{why}: leaked {node.channel_nodes()} {node.specs()}\n{node.agent.tail(40)}"
            assert node.channel_nodes() == [] and node.specs() == [], leaked
            assert imex_processes(root) == [] and node.daemon_dirs() == [], f"{why}: a daemon leaked"
            entries = (rest.get(COMPUTE_DOMAINS, NS, "job").get("status") or {}).get("nodes", [])
            assert entries == [], f"{why}: status.nodes names a daemon that is gone: {entries}"
        kubelet.wait_for_driver(DRIVER, timeout=30)
        # the kubelet retries the prepare it saw fail, then the pod ends: nothing may be left
        result = retried(lambda: kubelet.prepare(DRIVER, [ref]))[ref.uid] if not state else None
        assert result is None or result.error == "", f"{why}: {result}"
        errors = retried(lambda: kubelet.unprepare(DRIVER, [ref]))
        assert errors == {ref.uid: ""}, why
        assert node.channel_nodes() == [] and node.specs() == [] and node.daemon_dirs() == [], why
        wait_for(lambda: imex_processes(root) == [], timeout=30, what=f"{why}: the daemon to stop")
        domain = rest.get(COMPUTE_DOMAINS, NS, "job")
        assert (domain.get("status") or {}).get("nodes", []) == [], why
        # within the kubelet's default grace period: once in a CI run on a loaded machine, 10 s were not enough
        assert node.agent.terminate(timeout=30) == 0, why
        assert imex_processes(root) == [], why
    if state:
        return "prepared before the kill"
    return "rolled back mid-prepare" if recovery["rolled_back"] else "killed before prepare began"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("trial", range(REGULAR_TRIALS))
def test_kill_9_during_channel_prepare_leaks_nothing(trial: int) -> None:
    seed = random.randrange(2**32)
    one_trial(seed, "All" if trial % 2 else "Single")


@pytest.mark.trials
@pytest.mark.timeout(3600)
def test_kill_9_during_channel_prepare_leaks_nothing_in_50_trials() -> None:
    outcomes: dict[str, int] = {}
    began = time.monotonic()
    for trial in range(50):
        outcome = one_trial(random.randrange(2**32), "All" if trial % 2 else "Single")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\n50 kill -9 trials: {outcomes}, {time.monotonic() - began:.0f}s")
    assert len(outcomes) >= 2  # both sides of the race were hit


def test_sigterm_with_the_api_server_gone_stops_the_agent_and_its_daemons_at_once() -> None:
    """Tried: a node agent running a domain's IMEX daemon, its API server gone, then SIGTERM (a drained node): it
    exits well within the pod's grace period and its daemon goes with it (its status write fails at once)."""
    with short_tmpdir("cdstop-") as root:
        server = fakes.apiserver.start(port=0)
        try:
            ref = _setup(server.rest(), "Single")
            node = Node(root, server.write_kubeconfig(root / "kubeconfig"))
            with FakeKubelet(node.agent.kubelet_root, timeout=30) as kubelet:
                node.start()
                kubelet.wait_for_driver(DRIVER, timeout=30)
                assert kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""
                assert len(imex_processes(root)) == 1
                server.stop()
                began = time.monotonic()
                assert node.agent.terminate(timeout=20) == 0
                took = time.monotonic() - began
        finally:
            node.agent.close()
            server.stop()
        assert took < 10, f"the agent took {took:.1f}s to stop"
        assert imex_processes(root) == []


def test_a_node_that_leaves_its_fabric_clique_withdraws_its_channels_and_republishes_on_return() -> None:
    """Tried: the fabric manager drops one GPU of a running node (registration NOT_STARTED), then restores it."""
    with short_tmpdir("cdfab-") as root, fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        _setup(rest, "Single")
        node = Node(root, server.write_kubeconfig(root / "kubeconfig"), "--resync-interval", "0.5")
        name = f"{NODE}-{DRIVER}"

        def published() -> bool:
            return any(s["metadata"]["name"] == name for s in rest.list(RESOURCE_SLICES)["items"])

        try:
            node.start()
            wait_for(published, timeout=30, what="the channels to be published")
            fake = FakeNvml(nvl72_node(0), root / "gpus.json")
            fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
            wait_for(lambda: not published(), timeout=30, what="the channels to be withdrawn")
            fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_COMPLETED)
            wait_for(published, timeout=30, what="the channels to come back")
            # the channels name the node's clique, by which the arbiter keeps a domain's gang in one clique
            body = rest.get(RESOURCE_SLICES, None, name)
            assert {d["attributes"]["cliqueID"]["string"] for d in body["spec"]["devices"]} == {
                f"{uuid.UUID(bytes=NVL72_CLUSTER_UUID)}.{NVL72_CLIQUE_ID}"
            }
            # a degraded bandwidth (healthMask DEGRADED_BW) withdraws them too: a clique that is not whole is
            # not offered to new domains
            fake.set_fabric(1, degraded=True)
            wait_for(lambda: not published(), timeout=30, what="the channels withdrawn on a degraded fabric")
            fake.set_fabric(1, degraded=False)
            wait_for(published, timeout=30, what="the channels back once the bandwidth is whole")
            assert node.agent.terminate() == 0
        finally:
            node.agent.close()
