"""End-to-end admission (opt-in: `make bench`): 32 nodes x 8 GPUs whose agents serve reservations over a fake
DGX H100, 1,000 gated pods of one GPU each in gangs of 1 to 8 across 4 queues. Admitted pods complete (are
deleted, grace period 0, as a kubelet confirms) at once, so all 1,000 pass through 256 GPUs. Prints pods
admitted per second, gate to committed (the gate removed), evictions per run, and where the arbiter's time went.

Two API servers: the fake (the controller stand-ins in this process), and the real control plane 1.37 with
kube-controller-manager and kube-scheduler at `--kube-api-qps=500` (burst 1,000). On the real one the same run
also gives, side by side on the same nodes: kube-scheduler alone (the same 1,000 pods ungated, no queue, 1 GPU
each, no gangs, the fence lifted), and the ceiling: a minimal client doing the arbiter's writes per pod (claim
finalizer, claim allocation, pod ungate) at the arbiter's commit concurrency.
"""

from __future__ import annotations

import contextlib
import copy
import random
import threading
import time
from concurrent import futures
from typing import Any

import pytest

from agent.arbiter.controller import Arbiter, ArbiterConfig
from agent.arbiter.names import ADMITTED_ANNOTATION, FENCE_RULE
from agent.arbiter.world import claim_names, is_gated
from agent.kube.errors import ApiError
from agent.kube.informer import Informer, start_all
from agent.kube.rest import DEVICE_TAINT_RULES, PODS, RESOURCE_CLAIMS
from fakes.cluster import FakeCluster, wait_for

PODS_TOTAL = 1000
QUEUES = 4


HOLD_GATE = "bench.gpu-dra-agent.io/hold"  # keeps the kube-scheduler case's pods back until their claims exist
CLIENT_QPS = 500
THRASH_S = 5.0  # an eviction this soon after the pod's admission, for a gang already waiting then: thrash


def _gangs(rng: random.Random) -> list[tuple[str, str, int]]:
    gangs = []
    left = PODS_TOTAL
    while left:
        size = min(left, rng.randint(1, 8))
        gangs.append((f"q{len(gangs) % QUEUES}", f"g{len(gangs)}", size))
        left -= size
    return gangs


def _claims_made(cluster: FakeCluster, pods: Informer, total: int) -> None:
    wait_for(lambda: sum(1 for p in pods.items() if len((p.get("status") or {}).get("resourceClaimStatuses") or ())
                         == 1) >= total, timeout=600, interval=0.2, what="claims from templates")


class Kubelet:
    """Completes pods once placed (the gate removed or bound) and confirms evictions: deletes with grace 0."""

    def __init__(self, cluster: FakeCluster, pods: Informer, placed: Any) -> None:
        self._rest = cluster.rest
        self._pods = pods
        self._placed = placed
        self.completed: dict[str, float] = {}  # pod key -> when it was seen placed
        self.evicted: dict[str, float] = {}  # pod key -> when it was seen being deleted by someone else
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            for p in self._pods.items():
                meta = p["metadata"]
                key = f"{meta['namespace']}/{meta['name']}"
                if meta.get("deletionTimestamp"):
                    if key not in self.completed:
                        self.evicted.setdefault(key, time.perf_counter())
                elif key not in self.completed and self._placed(p):
                    self.completed[key] = time.perf_counter()
                else:
                    continue
                with contextlib.suppress(ApiError):
                    self._rest.delete(PODS, meta["namespace"], meta["name"], grace_period_s=0)
            self._stop.wait(0.005)


def _arbiter_run(cluster: FakeCluster, label: str, config: ArbiterConfig) -> dict[str, float]:
    rng = random.Random(7)
    cluster.queue("root")
    for q in range(QUEUES):
        cluster.queue(f"q{q}", parent="root", gpu_quota=64)
    gangs = _gangs(rng)
    pods = Informer(cluster.rest, PODS)
    start_all([pods], 60)
    for q, name, size in gangs:
        cluster.gang(f"ns-{q}", name, q, pods=size, gpus=1)
    _claims_made(cluster, pods, PODS_TOTAL)
    ungated_at, evicted_at = _watch_writes(cluster)

    def placed(p: dict[str, Any]) -> bool:
        return not is_gated(p)

    with Kubelet(cluster, pods, placed) as kubelet:
        start = time.perf_counter()
        arbiter = cluster.arbiter(config)
        wait_for(lambda: len(kubelet.completed) + len(kubelet.evicted) >= PODS_TOTAL and
                 not pods.items(), timeout=900, interval=0.05, what="all admitted")
        admitted_at = dict(kubelet.completed)
        wall = max(admitted_at.values()) - start
    pods.stop()
    # every gang was waiting from the start, so an eviction within THRASH_S of the pod's admission is thrash
    thrash = sum(1 for k, t in evicted_at.items() if k in ungated_at and t - ungated_at[k] < THRASH_S)
    rate = len(admitted_at) / wall
    print(f"\n{label}: 32 nodes x 8 GPUs, {PODS_TOTAL} pods in {len(gangs)} gangs of 1-8 across {QUEUES} queues:")
    evictions = sum(arbiter.evictions.values())
    causes = ", ".join(f"{k} {v}" for k, v in sorted(arbiter.evictions.items())) or "none"
    print(f"  admitted {len(admitted_at)} pods in {wall:.2f} s: {rate:.1f} pods/s gate to committed; "
          f"evictions {evictions} ({causes}; thrash {thrash})")
    _where(arbiter)
    cluster.stop_arbiters()
    return {"pods_s": rate, "evictions": evictions, "thrash": thrash}


def _watch_writes(cluster: FakeCluster) -> tuple[dict[str, float], dict[str, float]]:
    """When the arbiter ungated each pod and when it evicted each: its writes, seen on the client they share."""
    rest = cluster.rest
    ungated: dict[str, float] = {}
    evicted: dict[str, float] = {}
    replace, evict = rest.replace, rest.evict

    def replacing(resource: Any, body: Any, subresource: str = "") -> Any:
        out = replace(resource, body, subresource)
        if resource == PODS and not is_gated(body) and ADMITTED_ANNOTATION in body["metadata"].get("annotations", {}):
            ungated.setdefault(f"{body['metadata']['namespace']}/{body['metadata']['name']}", time.perf_counter())
        return out

    def evicting(namespace: str, name: str, uid: str | None = None) -> None:
        evict(namespace, name, uid)
        evicted.setdefault(f"{namespace}/{name}", time.perf_counter())

    rest.replace, rest.evict = replacing, evicting  # type: ignore[method-assign]
    return ungated, evicted


def _where(arbiter: Arbiter) -> None:
    print(f"  arbiter cycles {arbiter.cycles}; time in: " + ", ".join(
        f"{k} {v:.2f} s" for k, v in sorted(arbiter.timings.items(), key=lambda kv: -kv[1])))
    print("  commit steps (summed over parallel commits): " + ", ".join(
        f"{k} {v:.2f} s" for k, v in arbiter._committer.timings.items()))


def _kube_scheduler_run(cluster: FakeCluster) -> float:
    """The same number of pods, 1 GPU each, no queue, no gang: kube-scheduler allocates and binds them. Held
    back by a gate of ours until their claims exist, then released all at once (8 writers)."""
    cluster.rest.delete(DEVICE_TAINT_RULES, None, FENCE_RULE)  # no arbiter: kube-scheduler allocates
    pods = Informer(cluster.rest, PODS)
    start_all([pods], 60)
    cluster.namespace("plain")
    with futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: cluster.pod("plain", f"p{i}", None, 1, gated=False, gates=[HOLD_GATE]),
                      range(PODS_TOTAL)))
    _claims_made(cluster, pods, PODS_TOTAL)

    def release(p: dict[str, Any]) -> None:
        body = copy.deepcopy(p)
        body["spec"]["schedulingGates"] = []
        with contextlib.suppress(ApiError):
            cluster.rest.replace(PODS, body)

    with Kubelet(cluster, pods, lambda p: bool(p["spec"].get("nodeName"))) as kubelet:
        start = time.perf_counter()
        with futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(release, pods.items()))
        wait_for(lambda: len(kubelet.completed) >= PODS_TOTAL, timeout=900, interval=0.05, what="all bound")
        wall = max(kubelet.completed.values()) - start
    pods.stop()
    rate = PODS_TOTAL / wall
    print(f"kube-scheduler: {PODS_TOTAL} pods of 1 GPU from a template, no gangs: {wall:.2f} s, {rate:.1f} pods/s "
          "ungate to bound")
    return rate


def _ceiling_run(cluster: FakeCluster, workers: int) -> float:
    """The arbiter's three writes per pod (claim finalizer, claim status with allocation and reservedFor, pod
    ungated) by a minimal client at the arbiter's commit concurrency, nothing else: what the API allows."""
    pods = Informer(cluster.rest, PODS)
    claims = Informer(cluster.rest, RESOURCE_CLAIMS)
    start_all([pods, claims], 60)
    cluster.queue("ceiling")
    for i in range(PODS_TOTAL):
        cluster.pod("ceiling", f"c{i}", "ceiling", 1)
    _claims_made(cluster, pods, PODS_TOTAL)
    cluster.rest.create(DEVICE_TAINT_RULES, None, {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceTaintRule", "metadata": {"name": FENCE_RULE},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com"},
                 "taint": {"key": "scheduling.gpu-dra-agent.io/arbiter", "effect": "NoSchedule"}}})
    nodes = sorted(cluster.agents)

    def commit(i_pod: tuple[int, dict[str, Any]]) -> None:
        i, pod = i_pod
        node, device = nodes[(i // 8) % len(nodes)], f"gpu-{i % 8}"
        (name,), _ = claim_names(pod)
        claim = copy.deepcopy(claims.get("ceiling", name))
        assert claim is not None
        claim["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
        claim = cluster.rest.replace(RESOURCE_CLAIMS, claim)
        claim["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpus", "driver": "gpu.nvidia.com", "pool": node, "device": device}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}},
            "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}]}
        cluster.rest.replace(RESOURCE_CLAIMS, claim, "status")
        body = copy.deepcopy(pod)
        body["spec"]["schedulingGates"] = []
        body["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
        body["metadata"].setdefault("annotations", {})[ADMITTED_ANNOTATION] = "2026-01-01T00:00:00Z"
        cluster.rest.replace(PODS, body)

    start = time.perf_counter()
    with futures.ThreadPoolExecutor(workers) as pool:
        list(pool.map(commit, enumerate(pods.items())))
    wall = time.perf_counter() - start
    pods.stop()
    claims.stop()
    rate = PODS_TOTAL / wall
    print(f"ceiling: the same 3 writes per pod by a minimal client, {workers} at once: {wall:.2f} s, "
          f"{rate:.1f} pods/s")
    return rate


@pytest.mark.bench
@pytest.mark.controlplane
@pytest.mark.timeout(3600)
def test_admission_on_the_real_control_plane(control_plane_binaries: Any) -> None:
    from tests.controlplane.cluster import ControlPlane

    config = ArbiterConfig(period_s=0.05)
    with ControlPlane(control_plane_binaries, client_qps=CLIENT_QPS).start() as cp:
        path = cp.write_kubeconfig(cp.workdir / "bench.kubeconfig")
        with FakeCluster(nodes=32, kubeconfig=path, make_node=cp.add_node) as cluster:
            print(f"\nreal control plane 1.37, kube-controller-manager and kube-scheduler --kube-api-qps="
                  f"{CLIENT_QPS} --kube-api-burst={2 * CLIENT_QPS}; arbiter client unlimited, "
                  f"{config.commit_workers} gangs committed at once")
            arbiter = _arbiter_run(cluster, "arbiter", config)
            scheduler = _kube_scheduler_run(cluster)
            ceiling = _ceiling_run(cluster, config.commit_workers)
    print(f"side by side (same run, same nodes): arbiter {arbiter['pods_s']:.1f} pods/s "
          f"({arbiter['evictions']:.0f} evictions, thrash {arbiter['thrash']:.0f}), kube-scheduler "
          f"{scheduler:.1f} pods/s, ceiling {ceiling:.1f} pods/s; arbiter / kube-scheduler "
          f"{arbiter['pods_s'] / scheduler:.2f}, arbiter / ceiling {arbiter['pods_s'] / ceiling:.2f}")
    assert arbiter["thrash"] == 0


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_admission_through_the_api() -> None:
    with FakeCluster(nodes=32, apiserver_process=True) as cluster:
        out = _arbiter_run(cluster, "arbiter, API fake", ArbiterConfig(period_s=0.05))
    assert out["thrash"] == 0
