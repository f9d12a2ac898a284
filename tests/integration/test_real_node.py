"""The node tier: upstream's kubelet 1.37 and containerd 2.4 (runc 1.5) run pods with the agent's claims.

One control plane and one real node (tests/node/node.py) per module: the kubelet registers the agent's
plugin from its own plugin directory, kube-scheduler allocates the examples' claims, the kubelet asks the
agent to prepare them and hands the CDI ids to containerd, which injects the stand-in device nodes and the
spec's environment into the containers. The fake NVML machine is `mixed-mig`: GPUs 0-1 split into MIG
devices (all-balanced), GPUs 2-3 whole H100s.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.claims import cdi
from fakes.nvml.control import FakeNvml
from fakes.nvml.driver_files import VERSION as DRIVER_VERSION
from fakes.nvml.machines import get_machine
from tests.conftest import CONTROL_PLANE_KEY, NODE_STACK_KEY, built_binaries
from tests.controlplane import build
from tests.controlplane.cluster import ControlPlane, wait_for
from tests.node import images
from tests.node.node import RealNode

pytestmark = [pytest.mark.node, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "daemonset" / "examples"
NS = "default"
CLAIMS = f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaims"
PODS = f"/api/v1/namespaces/{NS}/pods"
# PID 1 of each container: prints nothing, stops at once on SIGTERM (busybox sh ignores it as PID 1 otherwise).
WORKLOAD = 'trap "exit 0" TERM; while :; do sleep 3600 & wait $!; done'
XID_DOUBLE_BIT_ECC = 48
PREPARE_CALL = 'Calling NodePrepareResources rpc" logger="dra-plugin" driverName="gpu.nvidia.com"'  # kubelet -v=4


@dataclass
class Site:
    cp: ControlPlane
    node: RealNode

    def get(self, path: str) -> Any:
        try:
            return self.cp.request("GET", path)
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def devices(self) -> dict[str, dict[str, Any]]:
        found = self.cp.request(
            "GET", f"/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{self.node.name}"
        )
        return {d["name"]: d for s in found["items"] for d in s["spec"].get("devices", [])}

    def kubelet_log(self) -> str:
        return self.node.components["kubelet"].log.read_text(errors="replace")


@dataclass
class RunningPod:
    name: str
    pod: dict[str, Any]
    claim: dict[str, Any]

    @property
    def devices(self) -> list[str]:
        return [r["device"] for r in self.claim["status"]["allocation"]["devices"]["results"]]

    def container_ids(self) -> dict[str, str]:
        return {s["name"]: s["containerID"].split("://", 1)[1] for s in self.pod["status"]["containerStatuses"]}


@pytest.fixture(scope="module")
def site(request: pytest.FixtureRequest) -> Iterator[Site]:
    binaries = built_binaries(request, CONTROL_PLANE_KEY, "node tier")
    stack = built_binaries(request, NODE_STACK_KEY, "node tier")
    with ControlPlane(binaries).start() as cp:
        for doc in yaml.safe_load_all((REPO / "daemonset" / "base" / "deviceclasses.yaml").read_text()):
            cp.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", doc)
        with RealNode(cp, stack, cdi_hook=_cdi_hook()).start() as node:
            yield Site(cp, node)


def _cdi_hook() -> Path | None:
    """NVIDIA's nvidia-cdi-hook (tests/container/cdi_hook.py builds it, ~1 minute cold), or None without Go."""
    from tests.container import cdi_hook

    try:
        return cdi_hook.build(budget_s=600)
    except build.BuildError:
        return None


def example(name: str, pod_name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The example's ResourceClaimTemplate and Pod, the pod made runnable here: the local workload image
    (never pulled), host network, no service-account token (no volume mounts to clean up)."""
    template, pod = yaml.safe_load_all((EXAMPLES / f"{name}.yaml").read_text())
    pod["metadata"]["name"] = pod_name
    spec = pod["spec"]
    spec.update(
        hostNetwork=True, automountServiceAccountToken=False, enableServiceLinks=False, terminationGracePeriodSeconds=5
    )
    for container in spec["containers"]:
        container.update(image=images.WORKLOAD_IMAGE, imagePullPolicy="Never", command=["/bin/sh", "-c", WORKLOAD])
    return template, pod


@contextlib.contextmanager
def running(site: Site, name: str, pod_name: str | None = None) -> Iterator[RunningPod]:
    """The example's pod, Running on the real node, with its claim; deleted (and waited gone) after."""
    template, pod = example(name, pod_name or name)
    with contextlib.suppress(urllib.error.HTTPError):  # already there from an earlier test
        site.cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{NS}/resourceclaimtemplates", template)
    site.cp.request("POST", PODS, pod)
    try:
        yield wait_running(site, pod["metadata"]["name"])
    finally:
        delete_pod(site, pod["metadata"]["name"])


def wait_running(site: Site, pod_name: str) -> RunningPod:
    def phase() -> dict[str, Any] | None:
        site.node.check_running()
        current = site.get(f"{PODS}/{pod_name}")
        if current and current.get("status", {}).get("phase") == "Failed":
            raise AssertionError(f"pod failed: {json.dumps(current['status'])}")
        return current if current and current.get("status", {}).get("phase") == "Running" else None

    try:
        pod = wait_for(f"pod {pod_name} to run", phase, 180)
    except AssertionError as error:
        current = site.get(f"{PODS}/{pod_name}")
        events = site.cp.request("GET", f"/api/v1/namespaces/{NS}/events")["items"]
        said = "\n".join(f"{e['reason']}: {e['message']}" for e in events if e["involvedObject"]["name"] == pod_name)
        raise AssertionError(
            f"{error}\nstatus: {json.dumps((current or {}).get('status'))}\nevents:\n{said}\n"
            f"kubelet:\n{site.node.components['kubelet'].tail(30)}"
        ) from None
    claim_name = pod["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = site.cp.request("GET", f"{CLAIMS}/{claim_name}")
    return RunningPod(pod_name, pod, claim)


def delete_pod(site: Site, pod_name: str) -> None:
    with contextlib.suppress(urllib.error.HTTPError):
        site.cp.request("DELETE", f"{PODS}/{pod_name}")
    wait_for(f"pod {pod_name} to be gone", lambda: None if site.get(f"{PODS}/{pod_name}") else True, 120)


def in_container(site: Site, pod: RunningPod, command: str, container: str = "ctr") -> str:
    return site.node.crictl("exec", pod.container_ids()[container], "/bin/sh", "-c", command)


def spec_path(site: Site, claim_uid: str) -> Path:
    return site.node.cdi_root / cdi.spec_file_name(claim_uid)


def checkpoint_path(site: Site, claim_uid: str) -> Path:
    return site.node.root / "state" / "claims" / f"{claim_uid}.json"


def gpu_index(device: str) -> int:
    return int(device.split("-")[1])


# -- registration ------------------------------------------------------------------------------------------


def test_the_kubelet_registers_the_plugin_from_its_own_plugin_directory(site: Site) -> None:
    agent = site.node.agent
    assert agent is not None
    # The registration socket lives in the kubelet's --root-dir, where its plugin watcher found it, and the
    # kubelet answered the agent's registration (NotifyRegistrationStatus registered=true).
    assert agent.registration_socket.parent == site.node.kubelet_root / "plugins_registry"
    assert agent.wait_for_log("registered with the kubelet", timeout=60)["driver"] == "gpu.nvidia.com"
    assert str(agent.registration_socket) in site.kubelet_log()
    # The node the kubelet registered (with its own certificate) is Ready and has the agent's devices.
    node = site.node.node_object()
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert {"gpu-2", "gpu-3"} <= set(site.devices())


# -- a pod with a claim ------------------------------------------------------------------------------------


def test_a_pod_with_a_gpu_claim_runs_with_the_devices_and_environment(site: Site) -> None:
    with running(site, "one-h100-80gb") as pod:
        assert pod.pod["spec"]["nodeName"] == site.node.name  # kube-scheduler placed it
        assert pod.claim["status"]["reservedFor"] == [
            {"resource": "pods", "name": pod.name, "uid": pod.pod["metadata"]["uid"]}
        ]
        [device] = pod.devices
        minor = gpu_index(device)
        nodes = in_container(site, pod, "ls /dev").split()
        assert f"nvidia{minor}" in nodes and "nvidiactl" in nodes and "nvidia-uvm" in nodes
        assert not [n for n in nodes if n.startswith("nvidia") and n[6:].isdigit() and n != f"nvidia{minor}"]
        # a character device with the stand-in's numbers (1:3, as /dev/null), so the runtime injected it
        assert in_container(site, pod, f"stat -c '%F %t:%T' /dev/nvidia{minor}").strip() == "character special file 1:3"
        env = dict(line.split("=", 1) for line in in_container(site, pod, "env").splitlines() if "=" in line)
        assert env["NVIDIA_VISIBLE_DEVICES"] == "void"  # the spec brings the driver: no legacy hook may add more
        assert env["DRA_RESOURCE_DRIVER_NAME"] == "gpu.nvidia.com"
        assert env["KUBERNETES_NODE_NAME"] == site.node.name
        assert spec_path(site, pod.claim["metadata"]["uid"]).exists()
        # The driver's libraries from the (fake) driver root, mounted read-only at the host's paths...
        libraries = in_container(site, pod, "ls /usr/lib/x86_64-linux-gnu/").split()
        assert f"libcuda.so.{DRIVER_VERSION}" in libraries and f"libnvidia-ml.so.{DRIVER_VERSION}" in libraries
        if site.node.cdi_hook is None:
            pytest.skip("nvidia-cdi-hook could not be built here (no Go): the loader-cache check needs it")
        # ...and the spec's nvidia-cdi-hook hooks, run by runc, made them resolvable by the loader.
        cache = in_container(site, pod, "ldconfig -p")
        assert "libcuda.so.1 " in cache and "libnvidia-ml.so.1 " in cache


def test_deleting_the_pod_unprepares_and_frees_the_gpu_for_the_next_pod(site: Site) -> None:
    with running(site, "one-h100-80gb", "first") as first:
        uid = first.claim["metadata"]["uid"]
        assert spec_path(site, uid).exists() and checkpoint_path(site, uid).exists()
    # The kubelet unprepared the claim before the pod went: the CDI spec and the checkpoint entry are gone.
    assert not spec_path(site, uid).exists()
    assert not checkpoint_path(site, uid).exists()
    # The resourceclaim controller removed the pod's claim, and with it the allocation.
    first_claim = f"{CLAIMS}/{first.claim['metadata']['name']}"
    wait_for("the first claim to go", lambda: None if site.get(first_claim) else 1, 90)
    with running(site, "one-h100-80gb", "second") as second:
        assert second.devices == first.devices


# -- restarts ----------------------------------------------------------------------------------------------


def _prepared_files(site: Site, uid: str) -> tuple[int, int]:
    return spec_path(site, uid).stat().st_mtime_ns, checkpoint_path(site, uid).stat().st_mtime_ns


def test_a_kubelet_restart_keeps_the_pod_and_prepares_nothing_twice(site: Site) -> None:
    agent = site.node.agent
    assert agent is not None
    with running(site, "one-h100-80gb", "across-kubelet-restart") as pod:
        uid = pod.claim["metadata"]["uid"]
        before = _prepared_files(site, uid)
        registrations = len([r for r in agent.logs() if r.get("msg") == "registered with the kubelet"])
        prepares = site.kubelet_log().count(PREPARE_CALL)
        assert prepares >= 1, "the kubelet's log no longer shows its prepare calls: update PREPARE_CALL"
        wiped = site.kubelet_log().count("Deleted ResourceSlices")
        site.node.restart_kubelet()
        wait_for(
            "the plugin to register again",
            lambda: (
                len([r for r in agent.logs() if r.get("msg") == "registered with the kubelet"]) > registrations or None
            ),
            90,
        )
        time.sleep(5)  # a sync of the pod after the restart: the kubelet would prepare here if it were to
        after = wait_running(site, pod.name)
        assert after.container_ids() == pod.container_ids()
        assert [s["restartCount"] for s in after.pod["status"]["containerStatuses"]] == [0]
        # The restarted kubelet took the claim from its own checkpoint: no new prepare call, no rewrite.
        assert site.kubelet_log().count(PREPARE_CALL) == prepares
        assert _prepared_files(site, uid) == before
        # It wiped the node's slices when it started (upstream does, for drivers not yet registered); the
        # agent published them again.
        assert site.kubelet_log().count("Deleted ResourceSlices") > wiped
        wait_for("the agent's slices to be back", lambda: pod.devices[0] in site.devices() or None, 60)
        assert in_container(site, after, "ls /dev/nvidia*")


def test_an_agent_killed_with_a_running_pod_comes_back_without_preparing_again(site: Site) -> None:
    with running(site, "one-h100-80gb", "across-agent-kill") as pod:
        uid = pod.claim["metadata"]["uid"]
        before = _prepared_files(site, uid)
        prepares = site.kubelet_log().count(PREPARE_CALL)
        site.node.kill_agent()
        agent = site.node.start_agent()
        agent.wait_for_log("registered with the kubelet", timeout=60)
        time.sleep(5)
        after = wait_running(site, pod.name)
        assert after.container_ids() == pod.container_ids()
        assert site.kubelet_log().count(PREPARE_CALL) == prepares
        assert _prepared_files(site, uid) == before
    # and the restarted agent unprepares it when the pod goes
    assert not spec_path(site, uid).exists() and not checkpoint_path(site, uid).exists()


# -- health ------------------------------------------------------------------------------------------------


def test_an_xid_taints_the_device_and_marks_the_pod_s_resource_unhealthy(site: Site) -> None:
    with running(site, "one-h100-80gb", "xid") as pod:
        [device] = pod.devices
        FakeNvml(get_machine(site.node.machine), site.node.gpu_state).inject_xid(gpu_index(device), XID_DOUBLE_BIT_ECC)
        taints = wait_for(f"{device} to be tainted", lambda: site.devices()[device].get("taints") or None, 90)
        assert {t["effect"] for t in taints} <= {"NoSchedule", "NoExecute"}

        def unhealthy() -> list[dict[str, Any]] | None:
            current = site.get(f"{PODS}/{pod.name}") or {}
            statuses = [
                r
                for s in current.get("status", {}).get("containerStatuses", [])
                for r in s.get("allocatedResourcesStatus", [])
            ]
            return statuses if any(h.get("health") == "Unhealthy" for r in statuses for h in r["resources"]) else None

        statuses = wait_for("the pod's allocatedResourcesStatus to say Unhealthy", unhealthy, 60)
        assert statuses[0]["name"] == "claim:gpu"  # the container's claim reference names no request


# -- MIG and MPS -------------------------------------------------------------------------------------------


def test_a_mig_claim_runs_with_the_parent_and_capability_nodes(site: Site) -> None:
    with running(site, "mig-1g10gb") as pod:
        [device] = pod.devices
        assert "-mig-1g10gb-" in device
        parent = gpu_index(device)
        assert f"nvidia{parent}" in in_container(site, pod, "ls /dev").split()
        # exactly the capability nodes the claim's spec names (its GPU and compute instance's), as the runtime
        # injected them from the spec the kubelet's CDI id pointed at
        spec = yaml.safe_load(spec_path(site, pod.claim["metadata"]["uid"]).read_text())
        named = {n["path"] for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]}
        caps = {p.rsplit("/", 1)[1] for p in named if p.startswith("/dev/nvidia-caps/")}
        assert len(caps) == 2
        assert set(in_container(site, pod, "ls /dev/nvidia-caps").split()) == caps


def test_an_mps_claim_is_shared_by_both_containers(site: Site) -> None:
    with running(site, "mps-shared-gpu") as pod:
        [device] = pod.devices
        minor = gpu_index(device)
        for container in ("ctr", "ctr2"):
            env = in_container(site, pod, "env", container)
            assert "CUDA_MPS_PIPE_DIRECTORY=" in env
            assert f"nvidia{minor}" in in_container(site, pod, "ls /dev", container).split()
        pipe = in_container(site, pod, 'ls "$CUDA_MPS_PIPE_DIRECTORY"')
        assert pipe.strip(), "the MPS control daemon's pipe directory is mounted and not empty"
