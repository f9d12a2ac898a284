"""A small GPU cluster for the queue arbiter, all fakes: the API server, the Queue CRD and DeviceClasses from
daemonset/, GPU nodes whose agents publish their slices and serve the reservation API over a fake NVML
machine, and the stand-ins for kube-controller-manager and kube-scheduler (fakes.controllers).

    with FakeCluster(nodes=2) as cluster:
        cluster.queue("team-a", gpu_quota=8)
        cluster.gang("team-a", "train", pods=2, gpus=8)
        arbiter = cluster.arbiter()            # in-process; or run `gpu-dra-agent arbiter --kubeconfig ...`

A node here is the agent's reservation side (agent.reservation.node_service over the real local allocator) and
its published ResourceSlices; kubelet and prepare are not involved (tests of the node agent cover them).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import yaml

from agent.arbiter.controller import Arbiter, ArbiterConfig
from agent.devices.model import Inventory
from agent.devices.shares import ShareMode
from agent.kube.errors import ApiError, Conflict
from agent.kube.events import EventRecorder
from agent.kube.informer import Informer
from agent.kube.kubeconfig import connect
from agent.kube.rest import (
    NODES,
    POD_GROUPS,
    PODS,
    QUEUES,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Resource,
    Rest,
)
from agent.names import ARBITER_USER, GATE, QUEUE_LABEL, RESERVATION_AUDIENCE
from agent.nvml.source import open_nvml
from agent.reservation.auth import TokenFile, TokenReviewer
from agent.reservation.node_service import POOL_INDEX, NodeReservations, claim_pools
from agent.slices.build import build_resource_slices
from fakes import apiserver
from fakes.controllers.runner import Controllers

DAEMONSET = pathlib.Path(__file__).resolve().parent.parent / "daemonset"
DRIVER = "gpu.nvidia.com"
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", False)
DEVICE_CLASSES = Resource("resource.k8s.io", "v1", "deviceclasses", False)
NAMESPACES = Resource("", "v1", "namespaces", False)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", True)

_inventories: dict[str, Inventory] = {}


def machine_inventory(machine: str) -> Inventory:
    """What the fake NVML reports for `machine` (discovered once per process)."""
    if machine not in _inventories:
        with open_nvml(f"fake:{machine}") as nvml:
            _inventories[machine] = nvml.discover()
    return _inventories[machine]


def manifest(*names: str) -> list[dict[str, Any]]:
    """The documents of the first of `names` found under daemonset/."""
    for name in names:
        found = sorted(DAEMONSET.rglob(name))
        if found:
            return [d for d in yaml.safe_load_all(found[0].read_text()) if d]
    raise FileNotFoundError(f"none of {names} under {DAEMONSET}")


def arbiter_token(rest: Rest, expiration_s: int = 3600) -> str:
    """A TokenRequest for the arbiter's ServiceAccount (created, with its namespace, when missing) for the node
    agents' audience: what kubelet projects into the arbiter's pod."""
    namespace, account = ARBITER_USER.split(":")[2:]
    with contextlib.suppress(Conflict):
        rest.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
    with contextlib.suppress(Conflict):
        rest.create(
            SERVICE_ACCOUNTS, namespace, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account}}
        )
    token_request = Resource("", "v1", f"serviceaccounts/{account}/token", True)  # a POST to the subresource
    answer = rest.create(
        token_request,
        namespace,
        {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"audiences": [RESERVATION_AUDIENCE], "expirationSeconds": expiration_s},
        },
    )
    return str(answer["status"]["token"])


class FakeCluster:
    def __init__(
        self,
        nodes: int = 2,
        machine: str = "dgx-h100",
        *,
        cpu: str = "224",
        memory: str = "2Ti",
        apiserver_process: bool = False,
        kubeconfig: pathlib.Path | None = None,
        make_node: Callable[[str], dict[str, Any]] | None = None,
        share_mode: ShareMode | None = None,
    ) -> None:
        """`share_mode`: the nodes publish their GPUs for consumable capacity (`--consumable-shares`).
        `apiserver_process`: run the API server fake as its own process (`python -m fakes.apiserver`), as a
        real one would be, instead of in this one (where tests can reach into it as `server`).
        `kubeconfig`: use that API server instead (the real control plane, whose kube-controller-manager and
        kube-scheduler do what the stand-ins do here: none is started); `make_node` creates a Ready Node there."""
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="arbiter-cluster-"))
        self.token = ""  # the arbiter's service-account token, once rotate_token() has asked for one
        self.token_file = self.root / "token"
        self.kubeconfig = kubeconfig or self.root / "kubeconfig"
        self._process: subprocess.Popen[str] | None = None
        self.server: apiserver.ApiServer | None = None
        self._make_node = make_node
        self.share_mode = share_mode
        if kubeconfig is not None:
            self.rest = connect(str(kubeconfig))
        elif apiserver_process:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "fakes.apiserver", "--port", "0", "--kubeconfig-out", str(self.kubeconfig)],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert self._process.stdout is not None
            self._process.stdout.readline()  # the URL, once it serves
            self.rest = connect(str(self.kubeconfig))
        else:
            self.server = apiserver.start(port=0)  # Kubernetes 1.37: PodGroups and a pod's schedulingGroup served
            self.server.write_kubeconfig(self.kubeconfig)
            self.rest = self.server.rest()
        for crd in manifest("queue-crd.yaml"):
            with contextlib.suppress(Conflict):  # a real server keeps it between tests
                self.rest.create(CRDS, None, crd)
        wait_for(lambda: _served(self.rest, QUEUES), timeout=30, what="the Queue CRD to be served")
        self.rest.list(POD_GROUPS)  # served: fail here, not in the first gang
        self.rotate_token()
        for klass in manifest("deviceclasses.yaml"):
            with contextlib.suppress(Conflict):
                self.rest.create(DEVICE_CLASSES, None, klass)
        self.inventory = machine_inventory(machine)
        self.agents: dict[str, NodeReservations] = {}
        # one claim informer for every node of this process: a real node watches claims on its own machine's
        # CPU; here one copy spares the process a decode of every claim event per node
        self._pools = claim_pools(DRIVER)
        self.node_claims = Informer(
            self.rest, RESOURCE_CLAIMS, indexers={POOL_INDEX: self._pools}, on_event=self._claim_seen
        )
        self.node_claims.start()
        for i in range(nodes):
            self.add_node(f"gpu-node-{i}", cpu=cpu, memory=memory)
        self.controllers = Controllers(self.rest, period_s=0.2).start() if kubeconfig is None else None
        self._arbiters: list[tuple[Arbiter, threading.Event, threading.Thread]] = []

    # -- the cluster --------------------------------------------------------------------------------------

    def _claim_seen(self, _type: str, claim: dict[str, Any]) -> None:
        for pool in self._pools(claim):
            agent = self.agents.get(pool)
            if agent is not None:
                agent.claim_seen(claim)

    def add_node(self, name: str, *, cpu: str = "224", memory: str = "2Ti") -> NodeReservations:
        if self._make_node is not None:
            node = self._make_node(name)
        else:
            node = self.rest.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})
            node["status"] = {
                "allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
                "conditions": [{"type": "Ready", "status": "True"}],
            }
            self.rest.replace(NODES, node, "status")
        for s in build_resource_slices(
            self.inventory, name, DRIVER, node_uid=node["metadata"]["uid"], share_mode=self.share_mode
        ):
            self.rest.create(RESOURCE_SLICES, None, s)
        # as the node agent checks the arbiter: its service-account token, through TokenReview
        agent = NodeReservations(
            node_name=name,
            driver=DRIVER,
            inventory=lambda: self.inventory,
            prepared=lambda: (),
            unhealthy=lambda: (),
            token=TokenReviewer(self.rest),
            rest=self.rest,
            claims=self.node_claims,
            share_mode=self.share_mode,
        )
        agent.start("127.0.0.1:0")
        self.agents[name] = agent
        return agent

    def arbiter(
        self, config: ArbiterConfig | None = None, *, start: bool = True, clock: Callable[[], float] = time.time
    ) -> Arbiter:
        """An arbiter in this process, running its cycles in a thread (stopped with the cluster)."""
        arbiter = Arbiter(
            self.rest,
            TokenFile(self.token_file),
            config or ArbiterConfig(period_s=0.2),
            recorder=EventRecorder(self.rest, "gpu-dra-arbiter", "test"),
            clock=clock,
        )
        arbiter.start()
        stop = threading.Event()
        thread = threading.Thread(target=arbiter.run, args=(stop,), name="arbiter", daemon=True)
        if start:
            thread.start()
        self._arbiters.append((arbiter, stop, thread))
        return arbiter

    def arbiter_process(
        self,
        *flags: str,
        kubeconfig: pathlib.Path | None = None,
        stdout: Any = subprocess.DEVNULL,
        stderr: Any = subprocess.DEVNULL,
    ) -> subprocess.Popen[bytes]:
        """`gpu-dra-agent arbiter` against this cluster in a process of its own (the package from the working
        directory, the checkout): its kubeconfig (or `kubeconfig`), its token file, no metrics server, then
        `flags`. The caller stops it."""
        command = [
            sys.executable,
            "-m",
            "agent.cli",
            "arbiter",
            "--kubeconfig",
            str(kubeconfig or self.kubeconfig),
            "--reservation-token-file",
            str(self.token_file),
            "--metrics-addr",
            "",
            *flags,
        ]
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        return subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr)

    def stop_arbiters(self) -> None:
        for arbiter, stop, thread in self._arbiters:
            stop.set()
            if thread.is_alive():
                thread.join(timeout=10)
            arbiter.stop()
        self._arbiters.clear()

    def close(self) -> None:
        self.stop_arbiters()
        if self.controllers is not None:
            self.controllers.stop()
        for agent in self.agents.values():
            agent.stop()
        self.node_claims.stop()
        # watches still open end here; their informers are stopping and say nothing
        if self.server is not None:
            self.server.stop()
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)  # its kubeconfig, token and logs: one per test otherwise

    def __enter__(self) -> FakeCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def rotate_token(self, expiration_s: int = 3600) -> str:
        """A new token of the arbiter's service account in `token_file`, as kubelet rotates a projected token:
        a new file in its place. The old token stays valid until it expires, as on a real cluster."""
        self.token = arbiter_token(self.rest, expiration_s)
        fresh = self.token_file.with_name(f".token-{secrets.token_hex(4)}")
        fresh.write_text(self.token)
        fresh.replace(self.token_file)
        return self.token

    # -- workloads ----------------------------------------------------------------------------------------

    def namespace(self, name: str) -> None:
        with contextlib.suppress(Conflict):  # exists already
            self.rest.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def queue(
        self,
        name: str,
        *,
        parent: str | None = None,
        gpu_quota: float = 0,
        gpu_limit: float = -1,
        weight: float = 1,
        priority: int | None = None,
        **spec: Any,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "resources": {
                "gpu": {"quota": gpu_quota, "limit": gpu_limit, "overQuotaWeight": weight},
                "cpu": {"quota": -1, "limit": -1, "overQuotaWeight": 1},
                "memory": {"quota": -1, "limit": -1, "overQuotaWeight": 1},
            },
            **spec,
        }
        if parent:
            body["parentQueue"] = parent
        if priority is not None:
            body["priority"] = priority
        return self.rest.create(
            QUEUES,
            None,
            {
                "apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1",
                "kind": "Queue",
                "metadata": {"name": name},
                "spec": body,
            },
        )

    def template(self, namespace: str, gpus: int) -> str:
        name = f"gpus-{gpus}"
        self.namespace(namespace)
        with contextlib.suppress(Conflict):  # exists already
            self.rest.create(
                RESOURCE_CLAIM_TEMPLATES,
                namespace,
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaimTemplate",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {
                        "spec": {
                            "devices": {
                                "requests": [
                                    {
                                        "name": "gpus",
                                        "exactly": {
                                            "deviceClassName": "gpu.nvidia.com",
                                            "allocationMode": "ExactCount",
                                            "count": gpus,
                                        },
                                    }
                                ]
                            }
                        }
                    },
                },
            )
        return name

    def pod(
        self,
        namespace: str,
        name: str,
        queue: str | None,
        gpus: int,
        *,
        group: str | None = None,
        priority: int | None = None,
        gated: bool = True,
        gates: Sequence[str] = (),
        spec_extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A pod with a claim of `gpus` GPUs from a template; with no queue and ungated, an ordinary DRA pod
        as kube-scheduler would get it before the arbiter's admission policy existed. `spec_extra`: more of its
        spec (a nodeSelector, tolerations)."""
        template = self.template(namespace, gpus)
        spec: dict[str, Any] = {
            "containers": [
                {
                    "name": "main",
                    "image": "trainer:1",
                    "resources": {"requests": {"cpu": "4", "memory": "16Gi"}, "claims": [{"name": "gpus"}]},
                }
            ],
            "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
            "terminationGracePeriodSeconds": 30,
        }
        if gated or gates:
            spec["schedulingGates"] = [{"name": g} for g in ([GATE] if gated else []) + list(gates)]
        if group:
            spec["schedulingGroup"] = {"podGroupName": group}
        if priority is not None:
            spec["priority"] = priority
        spec.update(spec_extra or {})
        return self.rest.create(
            PODS,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "labels": {QUEUE_LABEL: queue} if queue else {}},
                "spec": spec,
            },
        )

    def gang(
        self,
        namespace: str,
        name: str,
        queue: str,
        *,
        pods: int,
        gpus: int,
        min_count: int | None = None,
        priority: int | None = None,
    ) -> list[dict[str, Any]]:
        self.namespace(namespace)
        group_spec: dict[str, Any] = {"schedulingPolicy": {"gang": {"minCount": min_count or pods}}}
        self.rest.create(
            POD_GROUPS,
            namespace,
            {
                "apiVersion": "scheduling.k8s.io/v1beta1",
                "kind": "PodGroup",
                "metadata": {"name": name, "namespace": namespace, "labels": {QUEUE_LABEL: queue}},
                "spec": group_spec,
            },
        )
        return [self.pod(namespace, f"{name}-{i}", queue, gpus, group=name, priority=priority) for i in range(pods)]

    # -- looking ------------------------------------------------------------------------------------------

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.rest.list(PODS, namespace)["items"]
        return items


def _served(rest: Rest, resource: Resource) -> bool:
    try:
        rest.list(resource)
    except ApiError:
        return False
    return True


def wait_for(check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll until `check()` is truthy; returns its value or raises TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what or check}")
        time.sleep(interval)
