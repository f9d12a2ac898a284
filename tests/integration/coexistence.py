"""The arbiter beside kube-scheduler (issue 18): arbiter gangs and ordinary DRA pods interleaved on the same
nodes, both schedulers live, on the API fake (fakes.controllers' binder as kube-scheduler) or the real control
plane. Shared by the fast test, the real-control-plane test and its opt-in loop.

What is checked at every moment: no device of the driver is in two allocated claims. A claim informer sees
every change in the API's order (a watch delivers them by resourceVersion), so its state after each event is
the API's state at that resourceVersion; the check runs on every event, not on samples.

Pods here never run (no kubelet): this module plays the kubelet's part. A pod that is bound (or admitted by
the arbiter) completes after `hold_s`, and a pod being deleted (an eviction) is confirmed gone; both by a
deletion with grace period 0, after which kube-controller-manager deallocates its claims.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from agent.arbiter.controller import Arbiter, ArbiterConfig
from agent.kube.errors import ApiError
from agent.kube.informer import Informer, start_all
from agent.kube.rest import PODS, RESOURCE_CLAIMS, Rest
from agent.objects.read import allocated_devices, is_gated
from fakes.cluster import DRIVER, FakeCluster

PLAIN_NS = "plain"
QUEUES = 4


@dataclass
class Outcome:
    gang_pods: int
    plain_pods: int
    seconds: float = 0.0
    collisions: dict[tuple[str, str], set[str]] = field(default_factory=dict)  # device -> claims seen on it
    done_gang: int = 0  # arbiter pods admitted and completed
    done_plain: int = 0  # ordinary pods bound and completed
    evicted: int = 0
    left: list[str] = field(default_factory=list)  # pods still there at the end

    def summary(self) -> str:
        return (
            f"{self.gang_pods} gang pods + {self.plain_pods} ordinary pods in {self.seconds:.1f} s: "
            f"{self.done_gang} + {self.done_plain} completed, {self.evicted} evicted, "
            f"{len(self.collisions)} devices ever in two claims"
        )


class Owners:
    """Which allocated claims hold each device of the driver, kept on every claim event; remembers every
    device that was ever in two claims at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_claim: dict[str, set[tuple[str, str]]] = {}
        self._by_device: dict[tuple[str, str], set[str]] = {}
        self.collisions: dict[tuple[str, str], set[str]] = {}

    def seen(self, kind: str, claim: dict[str, Any]) -> None:
        m = claim.get("metadata") or {}
        key = f"{m.get('namespace')}/{m.get('name')}"
        devices = set() if kind == "DELETED" else set(allocated_devices(claim, DRIVER))
        with self._lock:
            for d in self._by_claim.pop(key, set()) - devices:
                self._by_device[d].discard(key)
            for d in devices:
                holders = self._by_device.setdefault(d, set())
                holders.add(key)
                if len(holders) > 1:
                    self.collisions.setdefault(d, set()).update(holders)
            if devices:
                self._by_claim[key] = devices


def run(
    cluster: FakeCluster,
    *,
    gang_pods: int,
    plain_pods: int,
    before: int,
    seed: int = 7,
    hold_s: float = 0.0,
    timeout_s: float = 600.0,
    config: ArbiterConfig | None = None,
    on_arbiter: Callable[[Arbiter], None] = lambda _: None,
) -> Outcome:
    """Create `before` ordinary pods, start the arbiter, then the rest of the ordinary pods and the gangs
    interleaved; complete every pod once placed; until all are gone or `timeout_s`."""
    rng = random.Random(seed)
    rest = cluster.rest
    gpus = len(cluster.agents) * len(cluster.inventory.gpus)
    cluster.queue("root")
    for q in range(QUEUES):
        cluster.queue(f"q{q}", parent="root", gpu_quota=gpus // QUEUES)
    cluster.queue("default")
    cluster.namespace(PLAIN_NS)
    outcome = Outcome(gang_pods, plain_pods)
    owners = Owners()
    claims = Informer(rest, RESOURCE_CLAIMS, on_event=owners.seen)
    kinds: dict[str, str] = {}  # pod key -> "gang" | "plain"
    placed: dict[str, float] = {}  # pod key -> when first seen placed (bound or admitted)
    finished: set[str] = set()
    lock = threading.Lock()

    def watch_pod(kind: str, pod: dict[str, Any]) -> None:
        m = pod.get("metadata") or {}
        key = f"{m.get('namespace')}/{m.get('name')}"
        with lock:
            if kind == "DELETED":
                finished.add(key)
            elif key not in placed and (
                pod["spec"].get("nodeName") or (kinds.get(key) == "gang" and not is_gated(pod))
            ):
                placed[key] = time.monotonic()

    pods = Informer(rest, PODS, on_event=watch_pod)
    start_all([claims, pods], 60)
    items: list[tuple[str, str, str, int]] = []  # (kind, namespace, name, size)
    left = gang_pods
    while left:
        size = min(left, rng.randint(1, 8))
        items.append(("gang", f"ns-q{len(items) % QUEUES}", f"g{len(items)}", size))
        left -= size
    plain = [("plain", PLAIN_NS, f"p{i}", 1) for i in range(plain_pods)]
    early, late = plain[:before], plain[before:]
    items += late
    rng.shuffle(items)

    def create(item: tuple[str, str, str, int]) -> None:
        kind, ns, name, size = item
        if kind == "plain":
            with lock:
                kinds[f"{ns}/{name}"] = "plain"
            cluster.pod(ns, name, None, 1, gated=False)
            return
        with lock:
            kinds.update({f"{ns}/{name}-{i}": "gang" for i in range(size)})
        cluster.gang(ns, name, f"q{ns[-1]}", pods=size, gpus=1)

    for ns in {ns for _, ns, _, _ in items}:
        cluster.namespace(ns)
    stop = threading.Event()

    def kubelet() -> None:  # completes placed pods, confirms deletions
        while not stop.is_set():
            now = time.monotonic()
            for pod in pods.items():
                m = pod["metadata"]
                key = f"{m['namespace']}/{m['name']}"
                with lock:
                    due = key in placed and now - placed[key] >= hold_s
                if m.get("deletionTimestamp") or due:
                    with contextlib.suppress(ApiError):
                        rest.delete(PODS, m["namespace"], m["name"], grace_period_s=0)
            stop.wait(0.02)

    started = time.monotonic()
    worker = threading.Thread(target=kubelet, name="kubelet", daemon=True)
    arbiter = None
    try:
        with futures.ThreadPoolExecutor(4) as pool:
            list(pool.map(create, early))
            worker.start()
            arbiter = cluster.arbiter(config or ArbiterConfig(period_s=0.05))
            on_arbiter(arbiter)
            list(pool.map(create, items))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with lock:
                if len(finished) >= len(kinds):
                    break
            time.sleep(0.1)
    finally:
        stop.set()
        worker.join(timeout=10)
        outcome.seconds = time.monotonic() - started
        cluster.stop_arbiters()
        claims.stop()
        pods.stop()
    with lock:
        outcome.collisions = {d: set(k) for d, k in owners.collisions.items()}
        outcome.done_gang = sum(1 for k in placed if kinds.get(k) == "gang" and k in finished)
        outcome.done_plain = sum(1 for k in placed if kinds.get(k) == "plain" and k in finished)
        outcome.left = sorted(set(kinds) - finished)
    outcome.evicted = sum(arbiter.evictions.values()) if arbiter is not None else 0
    return outcome


def force_delete_pods(rest: Rest, namespaces: list[str]) -> None:
    """No kubelet confirms a bound pod's deletion: remove what a run left, before the namespaces go."""
    for ns in namespaces:
        for pod in rest.list(PODS, ns)["items"]:
            with contextlib.suppress(ApiError):
                rest.delete(PODS, ns, pod["metadata"]["name"], grace_period_s=0)
