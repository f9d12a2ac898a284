"""Nodes of a fake GB200 NVL72 rack for ComputeDomain tests and the demo, all fakes but the agent's own code.

    with NvlRack(tmp_path, nodes=5) as rack:
        rack.apply(yaml_documents)          # a ComputeDomain, pods with channel claims...
        rack.wait_for(lambda: ...)

On the API fake (or a real API server, `kubeconfig=`): the ComputeDomain CRD and the device classes from
daemonset/, the ComputeDomain controller, kube-controller-manager's and kube-scheduler's stand-ins
(fakes.controllers), and per node `gb200-nvl72-nodeNN`: a Ready Node, its GPU slices (what the node agent
publishes for the fake NVML machine), the compute-domain plugin of the node agent in this process with its own
kubelet root, state dir, CDI root and dev root under `root/<node>/`, and a kubelet stand-in (`NodeKubelet`) that
prepares the compute-domain claims of the pods bound to the node over the plugin's real gRPC sockets and
unprepares them when the pod goes. GPU claims are allocated but not prepared here: the node agent's own tests
prepare GPUs; one process cannot hold 18 fake NVML machines. Node addresses are 127.0.0.<n+1>.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import fakes.nvml as fake_nvml
from agent.claims.types import ClaimRef
from agent.computedomain.channels import node_clique
from agent.computedomain.controller import COMPONENT, ComputeDomainController
from agent.computedomain.model import DRIVER
from agent.computedomain.plugin import ComputeDomainPlugin, ComputeDomainSettings
from agent.devices.model import Inventory
from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.events import EventRecorder
from agent.kube.kubeconfig import connect
from agent.kube.rest import (
    COMPUTE_DOMAINS,
    DEVICE_CLASSES,
    NODES,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Resource,
    Rest,
)
from agent.nvml.discovery import discover
from agent.nvml.session import nvml_session
from agent.slices.build import build_resource_slices
from fakes import apiserver
from fakes.cluster import CRDS, DAEMONSET, NAMESPACES, _served, wait_for
from fakes.controllers.runner import Controllers
from fakes.kubelet import FakeKubelet, KubeletError
from fakes.nvml import persist
from fakes.nvml.binaries import PROC_DEVICES, install_driver_root
from fakes.nvml.control import FakeNvml
from fakes.nvml.machines import nvl72_node

log = logging.getLogger(__name__)

GPU_DRIVER = "gpu.nvidia.com"
OVERLAY = DAEMONSET / "overlays" / "compute-domains"


def _documents(path: pathlib.Path) -> list[Json]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d]


class NodeKubelet:
    """The kubelet's DRA side for one node's pods, for the compute-domain driver only: prepare a bound pod's
    claims of that driver (retried each round until it succeeds, as the pod worker does), unprepare them when the
    pod is deleted, then let the pod go (delete with grace 0, as the kubelet confirms)."""

    def __init__(self, rest: Rest, node: str, kubelet: FakeKubelet) -> None:
        self.rest = rest
        self.node = node
        self.kubelet = kubelet
        self.prepared: dict[str, dict[str, tuple[str, ...]]] = {}  # pod uid -> claim uid -> CDI device ids
        self._refs: dict[str, list[ClaimRef]] = {}
        self.errors: dict[str, str] = {}  # pod "ns/name" -> the last prepare error

    def sync(self) -> None:
        pods = [p for p in self.rest.list(PODS)["items"] if (p.get("spec") or {}).get("nodeName") == self.node]
        live = set()
        for pod in pods:
            uid = pod["metadata"]["uid"]
            live.add(uid)
            if pod["metadata"].get("deletionTimestamp"):
                if self._release(uid):
                    with contextlib.suppress(NotFound):
                        self.rest.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"], grace_period_s=0)
            elif uid not in self.prepared:
                self._prepare(pod)
        for uid in set(self.prepared) - live:  # deleted at once (grace 0) by someone else
            self._release(uid)

    def _prepare(self, pod: Json) -> None:
        meta = pod["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        refs = []
        for status in (pod.get("status") or {}).get("resourceClaimStatuses") or ():
            name = status.get("resourceClaimName")
            if not name:
                continue
            try:
                claim = self.rest.get(RESOURCE_CLAIMS, meta["namespace"], name)
            except NotFound:
                return
            results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")
            if not results:
                return  # not allocated yet
            if any(r.get("driver") == DRIVER for r in results):
                refs.append(ClaimRef(meta["namespace"], claim["metadata"]["uid"], name))
        if not refs:
            return
        try:
            results = self.kubelet.prepare(DRIVER, refs)
        except KubeletError as exc:
            self.errors[key] = str(exc)
            return
        failed = {uid: r.error for uid, r in results.items() if r.error}
        if failed:
            self.errors[key] = "; ".join(failed.values())
            return
        self.errors.pop(key, None)
        self._refs[meta["uid"]] = refs
        self.prepared[meta["uid"]] = {
            uid: tuple(i for d in r.devices for i in d.cdi_device_ids) for uid, r in results.items()
        }
        with contextlib.suppress(ApiError):
            pod["status"] = {
                **(pod.get("status") or {}),
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True"}],
            }
            self.rest.replace(PODS, pod, "status")

    def _release(self, pod_uid: str) -> bool:
        refs = self._refs.get(pod_uid)
        if refs is None:
            self.prepared.pop(pod_uid, None)
            return True
        try:
            errors = self.kubelet.unprepare(DRIVER, refs)
        except KubeletError:
            return False
        if any(errors.values()):
            return False
        self._refs.pop(pod_uid)
        self.prepared.pop(pod_uid)
        return True


class RackNode:
    def __init__(self, rack: NvlRack, index: int) -> None:
        self.index = index
        self.name = f"gb200-nvl72-node{index:02d}"
        self.machine = nvl72_node(index)
        self.root = rack.root / f"n{index:02d}"  # short: unix socket paths under it have 107 bytes
        self.address = f"127.0.0.{index + 1}"
        self.kubelet_root = self.root / "kubelet"
        self.cdi_root = self.root / "cdi"
        self.state_dir = self.root / "state"
        self.dev_root = self.root / "dev-root"
        self.gpu_state = self.root / "gpus.json"  # FAKE_NVML_STATE: the fabric a test breaks, the fake imex reads
        for d in (self.kubelet_root, self.cdi_root, self.state_dir, self.dev_root):
            d.mkdir(parents=True, exist_ok=True)
        self.fake = FakeNvml(self.machine, self.gpu_state)
        self.settings = ComputeDomainSettings(
            node_name=self.name,
            kubelet_root=self.kubelet_root,
            cdi_root=self.cdi_root,
            state_dir=self.state_dir,
            driver_root=rack.driver_root,
            ip_address=self.address,
            dev_root=self.dev_root,
            proc_devices=rack.driver_root / PROC_DEVICES,
            channel_count=rack.channel_count,
            check_interval_s=0.2,
            daemon_env={persist.ENV: str(self.gpu_state)},
        )
        self.plugin: ComputeDomainPlugin | None = None
        self.kubelet = FakeKubelet(self.kubelet_root, timeout=30.0)
        self.pods = NodeKubelet(rack.rest, self.name, self.kubelet)

    def inventory(self) -> Inventory:
        """What the node agent discovers on this node now (its fake GPUs' state, fabric included)."""
        with fake_nvml.install(self.machine, self.gpu_state), nvml_session():
            return discover()

    def start_plugin(self, rest: Rest, node_uid: str, clique: str | None) -> None:
        self.plugin = ComputeDomainPlugin(self.settings, rest, clique, boot_id="fake-boot")
        self.plugin.start(node_uid)
        wait_for(
            lambda: self.kubelet.scan() or _registered(self.kubelet),
            timeout=30,
            what=f"{self.name}'s compute-domain plugin to register",
        )

    def channel_nodes(self) -> list[str]:
        return channel_nodes(self.dev_root)

    def cdi_specs(self) -> list[str]:
        return sorted(p.name for p in self.cdi_root.iterdir())

    def daemon_nodes(self) -> dict[str, list[str]]:
        return daemon_nodes(self.state_dir)


def channel_nodes(dev_root: pathlib.Path) -> list[str]:
    """The IMEX channel device nodes the node agent made under its dev root."""
    directory = dev_root / "dev" / "nvidia-caps-imex-channels"
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def daemon_nodes(state_dir: pathlib.Path) -> dict[str, list[str]]:
    """Domain uid -> the peers its running IMEX daemon loaded (what the fake nvidia-imex recorded), for the node
    agent whose --state-dir this is."""
    import json

    out = {}
    for status in (state_dir / "compute-domains" / "domains").glob("*/imexd.cfg.fake-imex.json"):
        with contextlib.suppress(OSError, ValueError):
            out[status.parent.name] = json.loads(status.read_text())["nodes"]
    return out


def _registered(kubelet: FakeKubelet) -> bool:
    try:
        kubelet.plugin(DRIVER)
    except Exception:
        return False
    return True


class NvlRack:
    def __init__(
        self,
        root: pathlib.Path | None = None,
        nodes: int = 4,
        *,
        channel_count: int = 2048,
        kubeconfig: pathlib.Path | None = None,
        cliques: Mapping[int, int] | None = None,
        make_node: Callable[[str], Json] | None = None,
    ) -> None:
        """`cliques`: node index -> clique ID, for a rack partitioned into several NVLink cliques (default: one).
        `kubeconfig`: a real API server, whose kube-scheduler and kube-controller-manager do what the stand-ins do
        here (none is started); `make_node(name)` creates a Ready Node there."""
        self._make_node = make_node
        self.root = pathlib.Path(root or tempfile.mkdtemp(prefix="nvl72-"))
        self.cliques = dict(cliques or {})
        self.channel_count = channel_count
        self.server: apiserver.ApiServer | None = None
        if kubeconfig is not None:
            self.rest = connect(str(kubeconfig))
        else:
            self.server = apiserver.start(port=0)
            self.rest = self.server.rest()
        self.driver_root = self.root / "driver-root"
        install_driver_root(self.driver_root)
        for crd in _documents(OVERLAY / "computedomain-crd.yaml"):
            with contextlib.suppress(Conflict):
                self.rest.create(CRDS, None, crd)
        wait_for(lambda: _served(self.rest, COMPUTE_DOMAINS), timeout=30, what="the ComputeDomain CRD")
        for path in (DAEMONSET / "base" / "deviceclasses.yaml", OVERLAY / "deviceclasses.yaml"):
            for klass in _documents(path):
                with contextlib.suppress(Conflict):
                    self.rest.create(DEVICE_CLASSES, None, klass)
        with contextlib.suppress(Conflict):
            self.rest.create(CRDS, None, MPI_JOB_CRD)
        self.mpi_operator = True  # the stand-in makes MPIJobs' worker pods (NVIDIA's nvbandwidth test is one)
        self.nodes = [RackNode(self, i) for i in range(nodes)]
        for node in self.nodes:
            self._add_node(node)
        self.stop = threading.Event()
        self.controller = ComputeDomainController(
            self.rest, period_s=0.5, recorder=EventRecorder(self.rest, COMPONENT, "rack")
        ).start()
        self._threads = [
            threading.Thread(target=self.controller.run, args=(self.stop,), daemon=True, name="cd-controller"),
            threading.Thread(target=self._kubelets, daemon=True, name="rack-kubelets"),
        ]
        self.controllers = Controllers(self.rest, period_s=0.2).start() if kubeconfig is None else None
        for t in self._threads:
            t.start()

    def _add_node(self, node: RackNode) -> None:
        body = self._make_node(node.name) if self._make_node is not None else self._create_node(node)
        if node.index in self.cliques:
            node.fake.set_fabric(None, clique_id=self.cliques[node.index])
        inventory = node.inventory()
        for s in build_resource_slices(inventory, node.name, GPU_DRIVER, node_uid=body["metadata"]["uid"]):
            self.rest.create(RESOURCE_SLICES, None, s)
        clique = node_clique([g.fabric for g in inventory.gpus])
        node.start_plugin(self.rest, body["metadata"]["uid"], clique)

    def _create_node(self, node: RackNode) -> Json:
        body = self.rest.create(
            NODES,
            None,
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node.name, "labels": {"kubernetes.io/hostname": node.name}},
            },
        )
        body["status"] = {
            "allocatable": {"cpu": "144", "memory": "800Gi", "pods": "110"},
            "capacity": {"cpu": "144", "memory": "800Gi", "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True"}],
            "addresses": [{"type": "InternalIP", "address": node.address}],
        }
        return self.rest.replace(NODES, body, "status")

    def _kubelets(self) -> None:
        while not self.stop.wait(0.2):
            if self.mpi_operator:
                with contextlib.suppress(ApiError):
                    mpi_workers(self.rest)
            for node in self.nodes:
                try:
                    node.pods.sync()
                except Exception:
                    log.exception("kubelet stand-in of %s", node.name)

    # -- workloads ----------------------------------------------------------------------------------------

    def namespace(self, name: str) -> None:
        with contextlib.suppress(Conflict):
            self.rest.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def apply(self, documents: Iterable[Json], namespace: str = "default") -> list[Json]:
        """Create each document as `kubectl create -f` would (Pods, ComputeDomains, ResourceClaimTemplates)."""
        self.namespace(namespace)
        out = []
        for doc in documents:
            resource = _resource(doc)
            out.append(self.rest.create(resource, namespace if resource.namespaced else None, doc))
        return out

    def domain(self, namespace: str, name: str) -> Json:
        return self.rest.get(COMPUTE_DOMAINS, namespace, name)

    def pod_node(self, namespace: str, name: str) -> RackNode | None:
        with contextlib.suppress(NotFound):
            node = (self.rest.get(PODS, namespace, name).get("spec") or {}).get("nodeName")
            return next((n for n in self.nodes if n.name == node), None)
        return None

    def wait_for(self, check: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
        return wait_for(check, timeout=timeout, what=what)

    def close(self) -> None:
        self.stop.set()
        if self.controllers is not None:
            self.controllers.stop()
        self.controller.stop()
        for node in self.nodes:
            node.kubelet.close()
            if node.plugin is not None:
                node.plugin.stop()
        for t in self._threads:
            t.join(timeout=10)
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> NvlRack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


MPI_JOBS = Resource("kubeflow.org", "v2beta1", "mpijobs", True)
# Kubeflow's MPIJob as far as the stand-in reads it (the real CRD's schema is the MPI operator's; not checked here)
MPI_JOB_CRD: Json = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "mpijobs.kubeflow.org"},
    "spec": {
        "group": "kubeflow.org",
        "scope": "Namespaced",
        "names": {"kind": "MPIJob", "listKind": "MPIJobList", "plural": "mpijobs", "singular": "mpijob"},
        "versions": [
            {
                "name": "v2beta1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def mpi_workers(rest: Rest) -> int:
    """The MPI operator's first step for each MPIJob: its Worker pods, `<job>-worker-<i>`, from the Worker
    template, owned by the job (deleted with it). The launcher, which the operator creates once the workers are
    ready (launcherCreationPolicy WaitForWorkersReady) and which runs mpirun, is not made: nothing runs here."""
    made = 0
    for job in rest.list(MPI_JOBS)["items"]:
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            continue
        worker = ((job.get("spec") or {}).get("mpiReplicaSpecs") or {}).get("Worker") or {}
        template = worker.get("template") or {}
        for i in range(int(worker.get("replicas") or 0)):
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    **(template.get("metadata") or {}),
                    "name": f"{meta['name']}-worker-{i}",
                    "ownerReferences": [
                        {
                            "apiVersion": "kubeflow.org/v2beta1",
                            "kind": "MPIJob",
                            "name": meta["name"],
                            "uid": meta["uid"],
                            "controller": True,
                        }
                    ],
                },
                "spec": template.get("spec") or {},
            }
            with contextlib.suppress(Conflict):
                rest.create(PODS, meta["namespace"], pod)
                made += 1
    return made


_KINDS = {
    "MPIJob": MPI_JOBS,
    "Pod": PODS,
    "ComputeDomain": COMPUTE_DOMAINS,
    "Namespace": NAMESPACES,
    "ResourceClaimTemplate": RESOURCE_CLAIM_TEMPLATES,
    "ResourceClaim": RESOURCE_CLAIMS,
}


def _resource(doc: Json) -> Resource:
    try:
        return _KINDS[doc["kind"]]
    except KeyError:
        raise ValueError(f"the rack does not create {doc.get('kind')} objects") from None
