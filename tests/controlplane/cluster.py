"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

    with ControlPlane(build.build(), workdir).start() as cp:
        api = kubernetes.client.ResourceV1Api(cp.api_client())
        cp.add_node("node-a")

No kubelet runs. Nodes are API objects made Ready once (and relieved of the not-ready taint admission puts
on new nodes); kube-controller-manager runs without its node-lifecycle controller, so nothing ever marks
them NotReady or taints them for missing heartbeats (a Lease renewer would only keep that controller quiet;
what we test is the scheduler and the claim controller). Pods bound to such a node never run: delete them
with grace period 0, as `kubectl delete --force` does, or they stay Terminating waiting for a kubelet.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

if TYPE_CHECKING:  # imported when called: `make control-plane` runs without the agent's dependencies
    from agent.kube.rest import Rest

from .pki import Pki, make_pki

# Gates beyond 1.37's defaults. Already on by default in 1.37 and used by the project: DRAPartitionableDevices,
# DRAConsumableCapacity, DRADeviceBindingConditions (beta); DRADeviceTaints, DRADeviceTaintRules,
# DRAExtendedResource, DRAPrioritizedList, DRAAdminAccess, DRAResourceClaimDeviceStatus (GA). Off by default
# and turned on here: GenericWorkload (beta; the scheduling.k8s.io/v1beta1 Workload and PodGroup gang API).
FEATURE_GATES = {"GenericWorkload": True}
# Beta API versions are served only when asked for.
RUNTIME_CONFIG = ("scheduling.k8s.io/v1beta1=true",)
# kube-controller-manager: what pods with claims need, and nothing that expects a kubelet.
CONTROLLERS = (
    "resourceclaim-controller",  # claims from templates, reservedFor clean-up, deallocation
    "garbage-collector-controller",  # deletes generated claims whose pod is gone
    "namespace-controller",
    "serviceaccount-controller",  # the `default` ServiceAccount pod admission requires
    "device-taint-eviction-controller",  # evicts pods from devices with NoExecute taints
    "podgroup-protection-controller",
    "root-ca-certificate-publisher-controller",  # kube-root-ca.crt, which every service-account token volume mounts
    "daemonset-controller",  # the product as deployed: the node agent's DaemonSet, the arbiter's Deployment
    "deployment-controller",
    "replicaset-controller",
    "job-controller",  # the chart's pre-delete hook (the arbiter's uninstall) is a Job
)
SERVICE_CIDR = "10.0.0.0/24"


class ControlPlaneError(RuntimeError):
    """A component did not start or exited; the message carries the tail of its log."""


T = TypeVar("T")


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float = 60.0,
    alive: Callable[[], None] = lambda: None,
    error: Callable[[str], Exception] = AssertionError,
) -> T:
    """`probe()`'s first value other than None, asked every 0.2s; `alive()` first each time (it raises when what
    is waited on has died). Past `timeout`, `error` ("timed out after ...s waiting for <what>") is raised: a
    test's failure by default, the harness's own error where the harness waits."""
    deadline = time.monotonic() + timeout
    while True:
        alive()
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            raise error(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the test process dies, so no server outlives a killed run."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 25) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise ControlPlaneError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class ControlPlane:
    def __init__(
        self,
        binaries: Path,
        workdir: Path | None = None,
        *,
        start_timeout: float = 120.0,
        client_qps: int | None = None,
    ) -> None:
        """`client_qps`: kube-controller-manager's and kube-scheduler's `--kube-api-qps` (burst twice that);
        upstream's defaults (20 and 50 requests/s) when None."""
        self.binaries = binaries
        self.client_qps = client_qps
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="controlplane-"))
        self.start_timeout = start_timeout
        self.components: list[Component] = []
        self.pki: Pki | None = None
        self.port = 0
        self.kubeconfig_path = self.workdir / "admin.kubeconfig"
        self.startup_seconds: dict[str, float] = {}

    # -- what tests use ------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def kubeconfig(self) -> dict[str, Any]:
        assert self.pki is not None, "start() first"

        def data(path: Path) -> str:
            return base64.b64encode(path.read_bytes()).decode()

        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "real", "cluster": {"server": self.url, "certificate-authority-data": data(self.pki.ca_cert)}}
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {
                        "client-certificate-data": data(self.pki.admin_cert),
                        "client-key-data": data(self.pki.admin_key),
                    },
                }
            ],
            "contexts": [{"name": "real", "context": {"cluster": "real", "user": "admin"}}],
            "current-context": "real",
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        out = Path(path)
        out.write_text(yaml.safe_dump(self.kubeconfig()))
        out.chmod(0o600)
        return out

    def rest(self) -> Rest:
        """The agent's own client (agent.kube.kubeconfig: TLS and a client certificate) with admin rights."""
        from agent.kube.kubeconfig import connect

        return connect(str(self.kubeconfig_path))

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient with admin rights on this control plane."""
        from kubernetes import config

        return config.new_client_from_config_dict(self.kubeconfig())

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        """A Node the scheduler will place pods on: schedulable, untainted, Ready, with room for pods."""
        node = self.request(
            "POST",
            "/api/v1/nodes",
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": labels or {}},
            },
        )
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"}
        node["status"] = {
            "capacity": capacity,
            "allocatable": capacity,
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "test node",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
            "nodeInfo": {
                "architecture": "amd64",
                "operatingSystem": "linux",
                "kubeletVersion": "v1.37.0",
                "kubeProxyVersion": "",
                "bootID": "",
                "machineID": "",
                "systemUUID": "",
                "containerRuntimeVersion": "",
                "kernelVersion": "",
                "osImage": "",
            },
        }
        node = self.request("PUT", f"/api/v1/nodes/{name}/status", node)
        # Admission (TaintNodesByCondition) gives every new node the not-ready taint; the node-lifecycle
        # controller, which does not run here, lifts it once the node reports Ready. Do its part once.
        taints = node["spec"].get("taints", [])
        node["spec"]["taints"] = [t for t in taints if t["key"] != "node.kubernetes.io/not-ready"]
        return self.request("PUT", f"/api/v1/nodes/{name}", node)

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One admin request; the decoded JSON answer. Errors raise urllib.error.HTTPError."""
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(req, context=self.ssl_context(), timeout=30) as response:
            return json.loads(response.read() or b"null")

    # -- start and stop ------------------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for component in reversed(self.components):  # clients first, etcd last
            component.stop()
        self.components.clear()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ControlPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _start(self) -> None:
        started = time.monotonic()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.pki = make_pki(self.workdir / "pki")
        etcd_port, peer_port = free_port(), free_port()
        etcd = self._spawn(
            "etcd",
            [
                "--name=default",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
                "--unsafe-no-fsync",  # throwaway data: durability costs seconds on a shared disk
                "--log-level=warn",
            ],
        )
        self._wait(etcd, lambda: self._get_plain(f"http://127.0.0.1:{etcd_port}/health"))
        self.startup_seconds["etcd"] = time.monotonic() - started

        self.port = free_port()
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
        pki = self.pki
        apiserver = self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--endpoint-reconciler-type=none",  # the `kubernetes` Service may not point at loopback; no pods use it
                f"--runtime-config={','.join(RUNTIME_CONFIG)}",
                f"--feature-gates={gates}",
                "--allow-privileged=true",  # as real clusters run: the node agent's DaemonSet is privileged
                # `kubectl logs`/`exec`: a real node's kubelet by its InternalIP (127.0.0.1), as a client it trusts
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-client-certificate={pki.admin_cert}",
                f"--kubelet-client-key={pki.admin_key}",
                "--profiling=false",
            ],
        )
        self._wait(apiserver, lambda: self._get_tls(f"{self.url}/readyz"))
        self.startup_seconds["kube-apiserver"] = time.monotonic() - started
        self.write_kubeconfig(self.kubeconfig_path)

        common = [
            f"--kubeconfig={self.kubeconfig_path}",
            f"--authentication-kubeconfig={self.kubeconfig_path}",
            f"--authorization-kubeconfig={self.kubeconfig_path}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            f"--feature-gates={gates}",
        ]
        if self.client_qps is not None:
            common += [f"--kube-api-qps={self.client_qps}", f"--kube-api-burst={2 * self.client_qps}"]
        kcm_port, scheduler_port = free_port(), free_port()
        kcm = self._spawn(
            "kube-controller-manager",
            [
                *common,
                f"--secure-port={kcm_port}",
                f"--controllers={','.join(CONTROLLERS)}",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
            ],
        )
        scheduler = self._spawn("kube-scheduler", [*common, f"--secure-port={scheduler_port}"])
        self._wait(kcm, lambda: self._get_tls(f"https://127.0.0.1:{kcm_port}/healthz", verify=False))
        self._wait(scheduler, lambda: self._get_tls(f"https://127.0.0.1:{scheduler_port}/readyz", verify=False))
        self._wait(kcm, self._default_service_account_exists)
        self.startup_seconds["all"] = time.monotonic() - started

    def _spawn(self, name: str, args: list[str]) -> Component:
        log = self.workdir / "logs" / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(
                [str(self.binaries / name), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        component = Component(name, process, log)
        self.components.append(component)
        return component

    def _wait(self, component: Component, ready: Any) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            component.check_running()
            if ready():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{component.name} not ready after {self.start_timeout:.0f}s:\n{component.tail()}"
                )
            time.sleep(0.1)

    def ssl_context(self, verify: bool = True) -> ssl.SSLContext:
        """TLS for admin requests: trusts the test CA (or nothing, `verify=False`), presents the admin cert."""
        assert self.pki is not None
        context = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        if not verify:  # kube-scheduler's and kube-controller-manager's own self-signed serving certificates
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        context.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return context

    @staticmethod
    def _get_plain(url: str) -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
        return False

    def _get_tls(self, url: str, verify: bool = True) -> bool:
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(url, context=self.ssl_context(verify), timeout=2) as r,
        ):
            return bool(r.status == 200)
        return False

    def _default_service_account_exists(self) -> bool:
        with contextlib.suppress(urllib.error.HTTPError):
            self.request("GET", "/api/v1/namespaces/default/serviceaccounts/default")
            return True
        return False


# Objects tests make, removed between tests that share one control plane (order: users before what they use).
_NAMESPACED = ("pods", "resourceclaims", "resourceclaimtemplates", "configmaps", "events")
_CLUSTER_SCOPED = (
    "/apis/resource.k8s.io/v1/resourceslices",
    "/apis/resource.k8s.io/v1/devicetaintrules",
    "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings",  # the arbiter overlay's gate
    "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies",
    "/apis/resource.k8s.io/v1/deviceclasses",
    "/api/v1/nodes",
)
_KEEP_NAMESPACES = frozenset({"default", "kube-system", "kube-public", "kube-node-lease"})
_KEEP_CONFIGMAPS = frozenset({"kube-root-ca.crt"})


def reset(cp: ControlPlane, timeout: float = 30.0) -> None:
    """Delete what tests create (pods forcibly, as no kubelet will ever confirm) and wait until claims are gone.

    Claims carry the controller's delete-protection finalizer until it has deallocated them, so waiting here
    keeps one test's allocations from leaking into the next test's scheduling.
    """
    namespaces = [n["metadata"]["name"] for n in cp.request("GET", "/api/v1/namespaces")["items"]]
    for namespace in namespaces:
        if namespace not in _KEEP_NAMESPACES:
            cp.request("DELETE", f"/api/v1/namespaces/{namespace}")
    for resource in _NAMESPACED:
        prefix = "/api/v1" if resource in ("pods", "configmaps", "events") else "/apis/resource.k8s.io/v1"
        path = f"{prefix}/namespaces/default/{resource}"
        if resource == "configmaps":
            for item in cp.request("GET", path)["items"]:
                if item["metadata"]["name"] not in _KEEP_CONFIGMAPS:
                    cp.request("DELETE", f"{path}/{item['metadata']['name']}")
            continue
        cp.request("DELETE", path + ("?gracePeriodSeconds=0" if resource == "pods" else ""))
    for path in _CLUSTER_SCOPED:
        cp.request("DELETE", path)
    deadline = time.monotonic() + timeout
    while True:
        left = [c["metadata"]["name"] for c in cp.request("GET", "/apis/resource.k8s.io/v1/resourceclaims")["items"]]
        left += [n["metadata"]["name"] for n in cp.request("GET", "/api/v1/namespaces")["items"]]
        left = [name for name in left if name not in _KEEP_NAMESPACES]
        if not left:
            return
        if time.monotonic() > deadline:
            names = ", ".join(left)
            raise ControlPlaneError(f"objects still present {timeout:.0f}s after reset: {names}")
        time.sleep(0.1)


def main() -> None:
    """`python -m tests.controlplane.cluster [NODE...]`: a control plane for trying things by hand (Ctrl-C stops).

    Writes the admin kubeconfig to ./controlplane.kubeconfig; `gpu-dra-agent node --kubeconfig` it to run the
    agent against it, or `make demo`-style experiments with kubectl.
    """
    import sys

    from .build import build

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # unwind through stop(): temp dirs go too
    with ControlPlane(build()).start() as cp:
        for node in sys.argv[1:]:
            cp.add_node(node)
        # admin credentials stay in the control plane's own directory, removed with it (not in the checkout)
        path = cp.kubeconfig_path
        print(f"kube-apiserver {cp.url} ready in {cp.startup_seconds['all']:.1f}s; KUBECONFIG={path}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
