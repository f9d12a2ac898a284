"""The product as an operator deploys it, on the real node: `helm install` of deployments/helm/gpu-dra-agent with
the test image (`make image`'s product plus the NVML fake layer) imported into the node's containerd, and no
agent as a host process. kubelet 1.37 runs the DaemonSet's pod; its probes pass through the kubelet; it
registers through the hostPath plugin directories and publishes the node's slices; workload pods get their
devices through it. Then the DaemonSet rolls to another image and back with claims in use (NVIDIA's
test_gpu_updowngrade as the model), and `helm uninstall` shows what it leaves. Then the chart again with the
arbiter: two replicas, one leads and admits a gang, the standby takes over when the leader's pod goes, and
`helm uninstall` removes the fence through its pre-delete hook. Last, `kubectl apply -k` / `delete -k` of
daemonset/ under a kustomization that sets this node's paths.

In-cluster clients reach the API server as the chart's apiServer.host/port say (KUBERNETES_SERVICE_HOST/PORT
pointed at loopback, the pods on the node's network): on these machines a test sends packets only to
127.0.0.0/8. The node's paths (kubelet root, CDI root, state directory, stand-in device nodes, the fake
driver root) are the chart's values. One control plane and one node for the module, several checks per start;
the tests run in file order and build on each other. Real nodes on one machine share fixed host paths, so
RealNode takes ~/.cache/gpu-dra-agent/real-node.lock.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.names import COMPONENT, DEFAULT_QUEUE, FENCE_RULE, GATE, QUEUE_LABEL
from fakes.nvml.binaries import install_driver_root
from tests.conftest import CONTROL_PLANE_KEY, NODE_STACK_KEY, built_binaries
from tests.controlplane import build as cp_build
from tests.controlplane.cluster import ControlPlane, free_port, wait_for
from tests.helm import build as helm_build
from tests.integration import test_real_node as real
from tests.node.images import builder as image_builder
from tests.node.node import RealNode, real_node_lock

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "gpu-dra-agent"
NS = "gpu-dra-agent"
RELEASE = "gpu-dra-agent"
AGENT_PODS = f"/api/v1/namespaces/{NS}/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Dnode"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NEXT = "next"  # the tag of image N+1: the same tree under another version label

pytestmark = [
    pytest.mark.node,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap is not installed (`make test` does)"),
]


@dataclass
class Deployed:
    cp: ControlPlane
    node: RealNode
    helm: str
    tags: dict[str, str]  # "current" / NEXT -> the image tag the chart names
    values: Path
    metrics_port: int
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def site(self) -> real.Site:
        return real.Site(self.cp, self.node)

    def run_helm(self, *args: str) -> str:
        done = subprocess.run(
            [self.helm, *args, "--kubeconfig", str(self.cp.kubeconfig_path)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 0, f"helm {' '.join(args)}: {done.stderr}"
        return done.stdout

    def install(self, *values: Path) -> str:
        """`helm install` of the chart into the namespace with the site's values, then `values` over them."""
        files = [arg for path in (self.values, *values) for arg in ("-f", str(path))]
        return self.run_helm("install", RELEASE, str(CHART), "--namespace", NS, "--create-namespace", *files)

    def agent_pods(self) -> list[dict[str, Any]]:
        return list(self.cp.request("GET", AGENT_PODS)["items"])

    def ready_agent(self, image: str, timeout: float = 240) -> dict[str, Any]:
        """The DaemonSet's one pod, of `image`, Running and Ready (its probes passed), once it is the only one."""

        def ready() -> dict[str, Any] | None:
            self.node.check_running()
            pods = self.agent_pods()
            if len(pods) != 1 or pods[0]["metadata"].get("deletionTimestamp"):
                return None
            pod = pods[0]
            conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
            spec_image = pod["spec"]["containers"][0]["image"]
            return pod if spec_image == image and conditions.get("Ready") == "True" else None

        try:
            return wait_for(f"the agent pod of {image} to be Ready", ready, timeout)
        except AssertionError as error:
            said = "\n".join(json.dumps(p.get("status")) for p in self.agent_pods())
            raise AssertionError(f"{error}\n{said}\nkubelet:\n{self.node.components['kubelet'].tail(30)}") from None

    def slices(self) -> list[dict[str, Any]]:
        return list(self.cp.request("GET", f"{SLICES}?fieldSelector=spec.nodeName%3D{self.node.name}")["items"])

    def pod_log(self, namespace: str, pod: str) -> str:
        """What `kubectl logs` reads: the API server asks the node's kubelet, at its InternalIP."""
        url = f"{self.cp.url}/api/v1/namespaces/{namespace}/pods/{pod}/log"
        with urllib.request.urlopen(url, context=self.cp.ssl_context(), timeout=30) as response:
            return str(response.read().decode())

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as response:
            return str(response.read().decode())


def _image_name(tag: str) -> str:
    return f"gpu-dra-agent:{tag}"


def _retagged(builder: Any, image: Any, tag: str, out: Path) -> Path:
    """Image N+1, cheaply: the same layers under another name and version label (a new config, so a new image
    id), as a release of the same tree would be."""
    with tarfile.open(image.path) as archive:
        docker = json.loads(archive.extractfile("manifest.json").read())[0]  # type: ignore[union-attr]
        config = json.loads(archive.extractfile(docker["Config"]).read())  # type: ignore[union-attr]
        blobs = [archive.extractfile(layer).read() for layer in docker["Layers"]]  # type: ignore[union-attr]
    layers = [builder.Blob(builder.MEDIA_LAYER, blob) for blob in blobs]
    config["config"]["Labels"]["org.opencontainers.image.version"] = tag
    path = out / f"gpu-dra-agent-{tag}.oci.tar"
    builder.write_archive(path, f"docker.io/library/{_image_name(tag)}", config, layers, 0)
    return path


@pytest.fixture(scope="module")
def deployed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    binaries = built_binaries(request, CONTROL_PLANE_KEY, "node tier")
    stack = built_binaries(request, NODE_STACK_KEY, "node tier")
    if cp_build.go_command() is None:
        pytest.skip(f"`go` is not on PATH to build helm {helm_build.version()}")
    helm = str(helm_build.build(budget_s=1200))
    builder = image_builder()
    work = tmp_path_factory.mktemp("deployed")
    _, test_image = builder.build(out=work / "image")
    current = test_image.name.rsplit(":", 1)[1]
    next_archive = _retagged(builder, test_image, NEXT, work / NEXT)
    # the lock before the control plane starts (RealNode takes it again, nested)
    with real_node_lock(), ControlPlane(binaries).start() as cp, RealNode(cp, stack, host_agent=False).start() as node:
        for archive in (test_image.path, next_archive):
            node.ctr("images", "import", "--snapshotter", "native", "--local", str(archive))
        labelled = node.node_object()
        labelled["metadata"].setdefault("labels", {})["nvidia.com/gpu.present"] = "true"
        cp.request("PUT", f"/api/v1/nodes/{node.name}", labelled)
        # the fake driver's binaries run in the agent's container: its python (the test image has the fake)
        driver_root = install_driver_root(node.root / "driver-root", python="/usr/bin/python3").parents[1]
        metrics_port, health_port = free_port(), free_port()
        values = work / "values.yaml"
        values.write_text(
            yaml.safe_dump(
                {
                    "image": {"repository": "gpu-dra-agent", "tag": current, "pullPolicy": "Never"},
                    "nvidiaDriverRoot": str(driver_root),
                    "apiServer": {"host": "127.0.0.1", "port": str(cp.port)},
                    "kubeletPlugin": {
                        "kubeletRoot": str(node.kubelet_root),
                        "cdiRoot": str(node.cdi_root),
                        "stateDir": str(node.root / "state"),
                        "devRoot": str(node.dev_root),
                        "hostNetwork": True,
                        "metricsPort": metrics_port,
                        "healthcheckPort": health_port,
                        # the node's network: listen on loopback only (entries named as the chart's replace them)
                        "containers": {
                            "gpus": {
                                "env": [
                                    {"name": "NVML", "value": f"fake:{node.machine}"},
                                    {"name": "METRICS_ADDR", "value": f"127.0.0.1:{metrics_port}"},
                                    {"name": "HEALTHCHECK_ADDR", "value": f"127.0.0.1:{health_port}"},
                                ]
                            }
                        },
                    },
                }
            )
        )
        yield Deployed(cp, node, helm, {"current": current, NEXT: NEXT}, values, metrics_port)


# -- helm install --------------------------------------------------------------------------------------------


def test_helm_install_runs_the_agent_pod_which_publishes_the_node_and_serves_claims(deployed: Deployed) -> None:
    started = time.monotonic()
    deployed.install()
    image = _image_name(deployed.tags["current"])
    first_slice = wait_for(
        "the node's first slice", lambda: deployed.slices() or None, 240, deployed.node.check_running
    )
    deployed.timings["slice"] = time.monotonic() - started
    pod = deployed.ready_agent(image)
    deployed.timings["ready"] = time.monotonic() - started
    print(
        f"helm install -> first slice {deployed.timings['slice']:.1f}s, agent pod Ready "
        f"{deployed.timings['ready']:.1f}s"
    )
    assert first_slice[0]["spec"]["driver"] == "gpu.nvidia.com"
    # Its service-account token mounted (kube-root-ca.crt published), the API server at loopback as the chart set.
    assert any(v.get("projected") for v in pod["spec"]["volumes"])
    # It registered through the hostPath plugin directories, the kubelet's own.
    kubelet_log = deployed.site.kubelet_log()
    assert str(deployed.node.kubelet_root / "plugins_registry" / "gpu.nvidia.com-reg.sock") in kubelet_log
    assert {"gpu-2", "gpu-3"} <= set(deployed.site.devices())
    # `kubectl logs` of the agent: the API server reaches the kubelet at the node's InternalIP.
    assert "registered with the kubelet" in deployed.pod_log(NS, pod["metadata"]["name"])
    # Its metrics, scraped from the pod's port (the node's network, loopback).
    assert "gpu_dra_fenced_claim_records" in deployed.metrics()

    # A workload pod with a claim runs with its device nodes and the driver's libraries from the driver root.
    with real.running(deployed.site, "one-h100-80gb", "workload") as workload:
        [device] = workload.devices
        minor = real.gpu_index(device)
        nodes = real.in_container(deployed.site, workload, "ls /dev").split()
        assert f"nvidia{minor}" in nodes and "nvidiactl" in nodes
        assert real.in_container(deployed.site, workload, f"stat -c '%t:%T' /dev/nvidia{minor}").strip() == "1:3"
        libraries = real.in_container(deployed.site, workload, "ls /usr/lib/x86_64-linux-gnu/").split()
        assert any(name.startswith("libcuda.so.") for name in libraries), libraries
        uid = workload.claim["metadata"]["uid"]
        assert real.spec_path(deployed.site, uid).exists()
        assert real.checkpoint_path(deployed.site, uid).exists()
    assert not real.spec_path(deployed.site, uid).exists()
    assert not real.checkpoint_path(deployed.site, uid).exists()


# -- rolling upgrade and downgrade with claims in use ---------------------------------------------------------


def _roll(deployed: Deployed, tag: str) -> dict[str, Any]:
    """`helm upgrade` to image `tag`: the DaemonSet rolls its pod (maxUnavailable 1); the new one Ready."""
    deployed.run_helm(
        "upgrade", RELEASE, str(CHART), "--namespace", NS, "-f", str(deployed.values), "--set", f"image.tag={tag}"
    )
    return deployed.ready_agent(_image_name(tag))


def _still_prepared(deployed: Deployed, pod: real.RunningPod) -> None:
    """The pod runs on, its claim still prepared on the node: the CDI spec and the checkpoint record are there,
    and the new agent reads the record (its next unprepare removes both)."""
    current = deployed.site.get(f"{real.PODS}/{pod.name}")
    assert current is not None and current["status"]["phase"] == "Running"
    assert current["status"]["containerStatuses"][0]["restartCount"] == 0
    uid = pod.claim["metadata"]["uid"]
    assert real.spec_path(deployed.site, uid).exists() and real.checkpoint_path(deployed.site, uid).exists()


def _delete_unprepares(deployed: Deployed, pod: real.RunningPod) -> None:
    uid = pod.claim["metadata"]["uid"]
    real.delete_pod(deployed.site, pod.name)
    assert not real.spec_path(deployed.site, uid).exists()
    assert not real.checkpoint_path(deployed.site, uid).exists()


def test_the_daemonset_rolls_up_and_down_with_claims_in_use(deployed: Deployed) -> None:
    site = deployed.site
    # Image N prepares a claim; image N+1 takes over the node while the pod runs.
    template, pod = real.example("one-h100-80gb", "held-by-n")
    with contextlib.suppress(urllib.error.HTTPError):  # made by the install's test
        site.cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{real.NS}/resourceclaimtemplates", template)
    site.cp.request("POST", real.PODS, pod)
    held_by_n = real.wait_running(site, "held-by-n")
    old_agent = deployed.agent_pods()[0]["metadata"]["name"]
    started = time.monotonic()
    new_agent = _roll(deployed, deployed.tags[NEXT])
    up_s = time.monotonic() - started
    assert new_agent["metadata"]["name"] != old_agent
    _still_prepared(deployed, held_by_n)
    # A pod of image N+1's time, then deleting N's pod: N+1 unprepares what N prepared.
    site.cp.request("POST", real.PODS, {**pod, "metadata": {"name": "held-by-next"}})
    held_by_next = real.wait_running(site, "held-by-next")
    _delete_unprepares(deployed, held_by_n)

    # A record of a newer checkpoint format (as image N+2 might leave behind on a downgrade) is fenced loudly.
    claims_dir = deployed.node.root / "state" / "claims"
    planted = claims_dir / "00000000-0000-0000-0000-0000000000aa.json"
    planted.write_text(json.dumps({"version": 99, "checksum": "sha256:0", "data": {}}))
    # Back to image N: it reads N+1's records, unprepares N+1's claim, prepares new ones.
    started = time.monotonic()
    back = _roll(deployed, deployed.tags["current"])
    down_s = time.monotonic() - started
    print(f"roll up {up_s:.1f}s, roll down {down_s:.1f}s (helm upgrade to the new agent pod Ready)")
    _still_prepared(deployed, held_by_next)
    log = deployed.pod_log(NS, back["metadata"]["name"])
    assert "00000000-0000-0000-0000-0000000000aa" in log and "newer than this agent" in log, log[-2000:]
    events = site.cp.request("GET", "/api/v1/events?fieldSelector=reason%3DClaimRecordFenced")
    assert events["items"], "no ClaimRecordFenced Event on the Node"
    assert "gpu_dra_fenced_claim_records 1.0" in deployed.metrics()
    planted.unlink()  # as the operator would, after upgrading again
    _delete_unprepares(deployed, held_by_next)
    with real.running(site, "one-h100-80gb", "after-roll") as after:
        assert after.devices


# -- helm uninstall ---------------------------------------------------------------------------------------


def test_helm_uninstall_leaves_running_pods_and_the_kubelet_withdraws_the_slices(deployed: Deployed) -> None:
    site = deployed.site
    template, pod = real.example("one-h100-80gb", "outlives-uninstall")
    site.cp.request("POST", real.PODS, pod)
    running = real.wait_running(site, "outlives-uninstall")
    uid = running.claim["metadata"]["uid"]
    started = time.monotonic()
    deployed.run_helm("uninstall", RELEASE, "--namespace", NS)
    wait_for("the agent pod to be gone", lambda: None if deployed.agent_pods() else True, 120)
    # The agent leaves its Node's slices (a restarting agent keeps its pool); the kubelet deletes a driver's
    # slices once its plugin is gone and does not come back.
    wait_for("the node's slices to be withdrawn", lambda: None if deployed.slices() else True, 180)
    print(f"helm uninstall -> slices gone {time.monotonic() - started:.1f}s")
    # The pod runs on with its devices; its claim stays prepared on the node (nothing unprepares it).
    current = site.get(f"{real.PODS}/outlives-uninstall")
    assert current is not None and current["status"]["phase"] == "Running"
    assert real.spec_path(site, uid).exists() and real.checkpoint_path(site, uid).exists()
    # What the chart made is gone; the namespace helm's --create-namespace made stays, empty of ours.
    assert not [
        c
        for c in site.cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]
        if c["metadata"]["name"].endswith("nvidia.com")
    ]
    roles = site.cp.request(
        "GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles?labelSelector=app.kubernetes.io%2Fname%3Dgpu-dra-agent"
    )
    assert not roles["items"]
    assert site.get(f"/api/v1/namespaces/{NS}") is not None
    assert not site.cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/daemonsets")["items"]


# -- the arbiter's Deployment: two replicas, one leads, the standby takes over ----------------------------------

ARBITER_PODS = f"/api/v1/namespaces/{NS}/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Darbiter"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{COMPONENT}"
PODGROUPS = f"/apis/scheduling.k8s.io/v1beta1/namespaces/{real.NS}/podgroups"


def _gang(deployed: Deployed, name: str) -> list[real.RunningPod]:
    """A PodGroup of two pods in the Queue `default`, each with one whole H100: gated by the chart's admission
    policy, admitted whole by the arbiter (which allocates their claims), bound by kube-scheduler."""
    site = deployed.site
    site.cp.request(
        "POST",
        PODGROUPS,
        {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: DEFAULT_QUEUE}},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}},
        },
    )
    template, pod = real.example("one-h100-80gb", name)
    with contextlib.suppress(urllib.error.HTTPError):  # made by an earlier test
        site.cp.request("POST", f"/apis/resource.k8s.io/v1/namespaces/{real.NS}/resourceclaimtemplates", template)
    for i in range(2):
        member = json.loads(json.dumps(pod))
        member["metadata"] = {"name": f"{name}-{i}", "labels": {QUEUE_LABEL: DEFAULT_QUEUE}}
        member["spec"]["schedulingGroup"] = {"podGroupName": name}
        created = site.cp.request("POST", real.PODS, member)
        assert any(g["name"] == GATE for g in created["spec"].get("schedulingGates", [])), "not gated"
    return [real.wait_running(site, f"{name}-{i}") for i in range(2)]


def _arbiters(deployed: Deployed) -> list[dict[str, Any]]:
    return [p for p in deployed.cp.request("GET", ARBITER_PODS)["items"] if not p["metadata"].get("deletionTimestamp")]


def _leader(deployed: Deployed, lease: str = LEASE, pods: list[dict[str, Any]] | None = None) -> tuple[str, str] | None:
    """The Lease's holder and which of `pods` (the arbiters by default) it is, each logging its identity when it
    runs; None until one of them holds it (a Lease left by an earlier install's leader, whose RBAC went before it
    could release it, names that leader until it expires)."""
    holder = ((deployed.site.get(lease) or {}).get("spec") or {}).get("holderIdentity")
    for pod in (_arbiters(deployed) if pods is None else pods) if holder else ():
        name = pod["metadata"]["name"]
        with contextlib.suppress(urllib.error.HTTPError):
            if holder in deployed.pod_log(NS, name):
                return name, holder
    return None


def test_the_arbiter_s_two_replicas_admit_a_gang_and_the_standby_takes_over(deployed: Deployed) -> None:
    site = deployed.site
    reservation_port = free_port()
    deployed.install(_arbiter_values(deployed, reservation_port))
    deployed.ready_agent(_image_name(deployed.tags["current"]))
    # A pod left from the uninstall test holds a GPU: the new agent unprepares it.
    with contextlib.suppress(urllib.error.HTTPError):
        real.delete_pod(site, "outlives-uninstall")
    running = lambda: [p for p in _arbiters(deployed) if p.get("status", {}).get("phase") == "Running"]  # noqa: E731
    wait_for("two arbiter pods running", lambda: len(running()) == 2 or None, 180, deployed.node.check_running)
    leader, holder = wait_for("an arbiter to lead", lambda: _leader(deployed), 120)
    first = _gang(deployed, "gang-a")
    assert {p.devices[0] for p in first} == {"gpu-2", "gpu-3"}  # both whole GPUs, one each
    assert f"admitted gang {real.NS}/gang-a" in deployed.pod_log(NS, leader)
    for pod in first:
        real.delete_pod(site, pod.name)

    # The leader's pod deleted: the standby takes the Lease and admits the next gang.
    started = time.monotonic()
    site.cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{leader}")
    new_leader, new_holder = wait_for(
        "the standby to lead", lambda: (lead := _leader(deployed)) and lead[1] != holder and lead, 120
    )
    takeover_s = time.monotonic() - started
    second = _gang(deployed, "gang-b")
    admitted_s = time.monotonic() - started
    print(f"arbiter takeover {takeover_s:.1f}s after the leader's pod was deleted; next gang running {admitted_s:.1f}s")
    assert new_leader != leader
    assert f"admitted gang {real.NS}/gang-b" in deployed.pod_log(NS, new_leader)
    for pod in second:
        real.delete_pod(site, pod.name)


def _arbiter_values(deployed: Deployed, reservation_port: int) -> Path:
    """The arbiter on the node's network too, beside the agent: two replicas on one node ask for no metrics
    port; the agent serves reservations on loopback (the Node's InternalIP, so the arbiter calls it there)."""
    base = yaml.safe_load(deployed.values.read_text())
    env = [
        *base["kubeletPlugin"]["containers"]["gpus"]["env"],
        {"name": "RESERVATION_ADDR", "value": f"127.0.0.1:{reservation_port}"},
    ]
    path = deployed.values.with_name("arbiter-values.yaml")
    path.write_text(
        yaml.safe_dump(
            {
                "arbiter": {"enabled": True, "hostNetwork": True, "metricsPort": 0},
                "kubeletPlugin": {"containers": {"gpus": {"env": env}}},
            }
        )
    )
    return path


def test_helm_uninstall_with_the_arbiter_removes_its_fence_and_gate_and_hands_waiting_pods_back(
    deployed: Deployed,
) -> None:
    site = deployed.site
    # A pod that waits for the arbiter (its Queue does not exist): gated.
    _, pod = real.example("one-h100-80gb", "waits-for-arbiter")
    pod["metadata"]["labels"] = {QUEUE_LABEL: "no-such-queue"}
    pod["spec"]["nodeSelector"] = {"no-such": "node"}  # once ungated, Pending: the agent is gone with the chart
    created = site.cp.request("POST", real.PODS, pod)
    assert any(g["name"] == GATE for g in created["spec"].get("schedulingGates", []))
    started = time.monotonic()
    deployed.run_helm("uninstall", RELEASE, "--namespace", NS)  # runs the pre-delete hook Job, then deletes
    print(f"helm uninstall with the arbiter: {time.monotonic() - started:.1f}s")
    assert site.get(f"/apis/resource.k8s.io/v1/devicetaintrules/{FENCE_RULE}") is None
    assert site.get(f"/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies/{GATE_POLICY}") is None
    assert site.get(LEASE) is None
    waiting = site.get(f"{real.PODS}/waits-for-arbiter")
    assert waiting is not None and not waiting["spec"].get("schedulingGates"), "still gated"
    # The hook's Job and its account went with it (hook-succeeded); what is left of ours: the namespace.
    assert not site.cp.request("GET", f"/apis/batch/v1/namespaces/{NS}/jobs")["items"]

    def left() -> list[str]:
        return [
            f"{kind}/{o['metadata']['name']}"
            for kind, path in LEFT_BEHIND
            for o in site.cp.request("GET", path)["items"]
            if ("gpu-dra" in o["metadata"]["name"] and "-test:" not in o["metadata"]["name"])  # the test's own
            or o["metadata"]["name"].endswith("nvidia.com")
        ]

    # The Queue CRD goes last (its Queues, the default one included, with it): the API server empties it first.
    with contextlib.suppress(AssertionError):
        wait_for("nothing of ours left", lambda: not left() or None, 60)
    assert left() == []
    real.delete_pod(site, "waits-for-arbiter")


GATE_POLICY = "gpu-dra-agent-arbiter-gate"
# where something of ours could be left behind
LEFT_BEHIND = [
    ("CustomResourceDefinition", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"),
    ("ClusterRole", "/apis/rbac.authorization.k8s.io/v1/clusterroles"),
    ("ClusterRoleBinding", "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings"),
    ("DeviceClass", "/apis/resource.k8s.io/v1/deviceclasses"),
    ("DeviceTaintRule", "/apis/resource.k8s.io/v1/devicetaintrules"),
    ("MutatingAdmissionPolicy", "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies"),
    ("ValidatingAdmissionPolicy", "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"),
    ("ServiceAccount", f"/api/v1/namespaces/{NS}/serviceaccounts"),
    ("ConfigMap", f"/api/v1/namespaces/{NS}/configmaps"),
    ("Lease", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases"),
]


# -- kubectl apply -k / delete -k -------------------------------------------------------------------------


def _kustomization(deployed: Deployed, directory: Path) -> Path:
    """daemonset/ as an operator would adapt it to this node: a kustomization of their own over it that sets
    what the chart's values set in the test (image, node paths, node network, loopback API server)."""
    values = yaml.safe_load(deployed.values.read_text())
    plugin = values["kubeletPlugin"]
    kubelet_root = plugin["kubeletRoot"]
    # base/daemonset.yaml's first four volumes and mounts, in its order
    paths = {
        0: f"{kubelet_root}/plugins",
        1: f"{kubelet_root}/plugins_registry",
        2: plugin["cdiRoot"],
        3: plugin["stateDir"],
    }
    container = "/spec/template/spec/containers/0"
    ops: list[dict[str, Any]] = [
        {"op": "add", "path": "/spec/template/spec/hostNetwork", "value": True},
        {"op": "replace", "path": f"{container}/image", "value": _image_name(deployed.tags["current"])},
        {"op": "replace", "path": f"{container}/imagePullPolicy", "value": "Never"},
        {
            "op": "replace",
            "path": f"{container}/ports",
            "value": [
                {"name": "metrics", "containerPort": plugin["metricsPort"], "protocol": "TCP"},
                {"name": "healthz", "containerPort": plugin["healthcheckPort"], "protocol": "TCP"},
            ],
        },
        {"op": "replace", "path": f"{container}/livenessProbe/grpc/port", "value": plugin["healthcheckPort"]},
        {"op": "replace", "path": "/spec/template/spec/volumes/5/hostPath/path", "value": values["nvidiaDriverRoot"]},
    ]
    for index, path in paths.items():
        ops.append({"op": "replace", "path": f"/spec/template/spec/volumes/{index}/hostPath/path", "value": path})
        ops.append({"op": "replace", "path": f"{container}/volumeMounts/{index}/mountPath", "value": path})
    env = {
        "KUBELET_ROOT": kubelet_root,
        "CDI_ROOT": plugin["cdiRoot"],
        "STATE_DIR": plugin["stateDir"],
        "NVIDIA_HOST_DRIVER_ROOT": values["nvidiaDriverRoot"],
        "NVIDIA_DEV_ROOT": plugin["devRoot"],
        "KUBERNETES_SERVICE_HOST": values["apiServer"]["host"],
        "KUBERNETES_SERVICE_PORT": values["apiServer"]["port"],
        **{e["name"]: e["value"] for e in plugin["containers"]["gpus"]["env"]},
    }
    env_patch = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": "gpu-dra-agent-node", "namespace": NS},
        "spec": {
            "template": {
                "spec": {
                    "containers": [{"name": "agent", "env": [{"name": k, "value": str(v)} for k, v in env.items()]}]
                }
            }
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [os.path.relpath(REPO / "daemonset", directory)],  # kustomize takes no absolute path
                "patches": [
                    {"target": {"kind": "DaemonSet", "name": "gpu-dra-agent-node"}, "patch": json.dumps(ops)},
                    {"patch": yaml.safe_dump(env_patch)},
                ],
            }
        )
    )
    return directory


def _kubectl(deployed: Deployed, *args: str) -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    done = subprocess.run(
        [kubectl, "--kubeconfig", str(deployed.cp.kubeconfig_path), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
    return done.stdout


def test_kubectl_apply_k_runs_the_agent_and_delete_k_removes_it(deployed: Deployed, tmp_path: Path) -> None:
    overlay = _kustomization(deployed, tmp_path / "node-r")
    started = time.monotonic()
    _kubectl(deployed, "apply", "--server-side", "-k", str(overlay))
    wait_for("the node's first slice", lambda: deployed.slices() or None, 240, deployed.node.check_running)
    deployed.ready_agent(_image_name(deployed.tags["current"]))
    print(f"kubectl apply -k -> agent pod Ready, slices published {time.monotonic() - started:.1f}s")
    assert {"gpu-2", "gpu-3"} <= set(deployed.site.devices())
    started = time.monotonic()
    _kubectl(deployed, "delete", "-k", str(overlay), "--wait=true")
    wait_for("the agent pod to be gone", lambda: None if deployed.agent_pods() else True, 120)
    wait_for("the node's slices to be withdrawn", lambda: None if deployed.slices() else True, 180)
    print(f"kubectl delete -k -> slices gone {time.monotonic() - started:.1f}s")
    assert deployed.site.get(f"/api/v1/namespaces/{NS}") is None  # the base's Namespace, deleted with it
    assert not [
        c
        for c in deployed.cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]
        if c["metadata"]["name"].endswith("nvidia.com")
    ]


# -- ComputeDomains: helm install --set resources.computeDomains.enabled=true ---------------------------------

CD_DRIVER = "compute-domain.nvidia.com"
CD_CONTROLLER_PODS = (
    f"/api/v1/namespaces/{NS}/pods?labelSelector=app.kubernetes.io%2Fcomponent%3Dcompute-domain-controller"
)
CD_LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/gpu-dra-compute-domains"
CD_CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/computedomains.resource.nvidia.com"
CD_DOMAINS = "/apis/resource.nvidia.com/v1beta1/namespaces/default/computedomains"
CD_FINALIZER = "resource.nvidia.com/computeDomain"
GB200_TRAY = "gb200-nvl72-node00"  # a compute tray of the fake NVL72 rack: its 4 GPUs in one fabric clique


def _compute_domain_values(deployed: Deployed, gpus: bool) -> Path:
    """ComputeDomains on, GPUs on or off; the node's fake NVML a GB200 tray (the chart's NVML entry replaced); the
    controller on the node's network (the API server at loopback, as the agent)."""
    base = yaml.safe_load(deployed.values.read_text())
    env = [e for e in base["kubeletPlugin"]["containers"]["gpus"]["env"] if e["name"] != "NVML"]
    path = deployed.values.with_name(f"compute-domain-values-{gpus}.yaml")
    path.write_text(
        yaml.safe_dump(
            {
                "resources": {"gpus": {"enabled": gpus}, "computeDomains": {"enabled": True}},
                "controller": {"hostNetwork": True},
                "kubeletPlugin": {
                    "containers": {"gpus": {"env": [*env, {"name": "NVML", "value": f"fake:{GB200_TRAY}"}]}}
                },
            }
        )
    )
    return path


def _compute_domain(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"numNodes": 1, "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}},
    }


@pytest.mark.parametrize("gpus", [True, False], ids=["with-gpus", "alone"])
def test_helm_install_with_compute_domains_runs_the_controller_and_publishes_the_channels(
    deployed: Deployed, gpus: bool
) -> None:
    """Tried: the chart with resources.computeDomains.enabled=true (NVIDIA's value) on a node whose GPUs are in a
    fabric clique, with resources.gpus.enabled true and false (GPUs left to a device plugin): the ComputeDomain
    CRD is served, the controller's replicas run Ready in the cluster and one leads, the node agent's pod publishes
    the compute-domain.nvidia.com slice (channel-0, daemon-0), beside its GPUs only with GPUs on (and only then
    the GPU device classes); `helm uninstall` takes all of it away (pods, slices, CRD, device classes, RBAC), a
    ComputeDomain the controller held included, and frees the controller's Lease."""
    site = deployed.site
    started = time.monotonic()
    deployed.install(_compute_domain_values(deployed, gpus))
    assert site.get(CD_CRD) is not None

    def channels() -> list[dict[str, Any]] | None:
        deployed.node.check_running()
        return [s for s in deployed.slices() if s["spec"]["driver"] == CD_DRIVER] or None

    [cd_slice] = wait_for("the node's compute-domain slice", channels, 240)
    slice_s = time.monotonic() - started
    deployed.ready_agent(_image_name(deployed.tags["current"]))
    devices = {d["name"]: d["attributes"] for d in cd_slice["spec"]["devices"]}
    assert devices["channel-0"]["type"]["string"] == "channel"
    assert devices["daemon-0"]["type"]["string"] == "daemon"
    classes = {c["metadata"]["name"] for c in site.cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]}
    assert {"compute-domain-daemon.nvidia.com", "compute-domain-default-channel.nvidia.com"} <= classes
    if gpus:  # one agent serves both drivers
        assert {"gpu-0", "gpu-3"} <= set(site.devices()) and "gpu.nvidia.com" in classes
    else:  # the GPUs are the device plugin's: none published, no class for them
        assert [s["spec"]["driver"] for s in deployed.slices()] == [CD_DRIVER]
        assert "gpu.nvidia.com" not in classes and "mig.nvidia.com" not in classes

    def controllers_ready() -> list[dict[str, Any]] | None:
        pods = site.cp.request("GET", CD_CONTROLLER_PODS)["items"]
        ready = [
            p
            for p in pods
            if {c["type"]: c["status"] for c in p.get("status", {}).get("conditions", [])}.get("Ready") == "True"
        ]
        return ready if len(ready) == 2 else None

    pods = wait_for("the controller's two replicas to be Ready", controllers_ready, 180, deployed.node.check_running)
    wait_for("one of them to lead", lambda: _leader(deployed, CD_LEASE, pods), 120)
    ready_s = time.monotonic() - started
    print(
        f"helm install with ComputeDomains (GPUs {'on' if gpus else 'off'}) -> compute-domain slice {slice_s:.1f}s, "
        f"controllers Ready {ready_s:.1f}s"
    )
    # a domain the controller holds by its finalizer: without the uninstall hook the CRD's deletion waited on it
    site.cp.request("POST", CD_DOMAINS, _compute_domain("outlives-uninstall"))

    def finalized() -> bool | None:
        domain = site.get(f"{CD_DOMAINS}/outlives-uninstall") or {}
        return True if CD_FINALIZER in (domain.get("metadata") or {}).get("finalizers", []) else None

    wait_for("the controller's finalizer on the domain", finalized, 60)

    started = time.monotonic()
    deployed.run_helm("uninstall", RELEASE, "--namespace", NS)
    wait_for("the agent pod to be gone", lambda: None if deployed.agent_pods() else True, 120)
    wait_for(
        "the controller pods to be gone",
        lambda: None if site.cp.request("GET", CD_CONTROLLER_PODS)["items"] else True,
        120,
    )
    wait_for("the node's slices to be withdrawn", lambda: None if deployed.slices() else True, 180)
    wait_for("the ComputeDomain CRD to go", lambda: None if site.get(CD_CRD) else True, 60)
    print(f"helm uninstall with ComputeDomains -> all gone {time.monotonic() - started:.1f}s")
    assert site.get(CD_LEASE) is None  # released by the hook: the next install leads at once
    names = [c["metadata"]["name"] for c in site.cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]]
    assert not [n for n in names if n.endswith("nvidia.com")]
    roles = site.cp.request(
        "GET", "/apis/rbac.authorization.k8s.io/v1/clusterroles?labelSelector=app.kubernetes.io%2Fname%3Dgpu-dra-agent"
    )
    assert not roles["items"]
    assert not site.cp.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments")["items"]
