"""End-to-end admission (opt-in: `make bench`): 32 nodes x 8 GPUs whose agents serve reservations over a fake
DGX H100, 1,000 gated pods of one GPU each in gangs of 1 to 8 across 4 queues. Pods complete (are deleted, grace
period 0, as a kubelet confirms) as soon as they are bound to their node (a gang's once all of its pods are), in
parallel as the nodes' kubelets would, so all 1,000 pass through 256 GPUs. Prints pods per second from the start
to the last bound (an admitted pod runs only once kube-scheduler has bound it), evictions per run, where the
arbiter's time went, where a GPU's turn goes (held by a claim, then waiting for the next), and the CPU each
process spent per pod while timed.

Two API servers: the fake (the controller stand-ins in this process), and the real control plane 1.37 with
kube-controller-manager and kube-scheduler at `--kube-api-qps=500` (burst 1,000). On the real one the same run
also gives, side by side on the same nodes: kube-scheduler alone (the same 1,000 pods ungated, no queue, 1 GPU
each, no gangs, the fence lifted, claims made without the arbiter overlay's claim policy), and the ceiling: a
minimal client doing the arbiter's writes per pod (claim allocation, pod ungate; the claim's finalizer comes with
the claim, from the overlay's policy, as for the arbiter) at the arbiter's commit concurrency.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import json
import os
import random
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent import futures
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from agent.arbiter.controller import ArbiterConfig
from agent.arbiter.uninstall import POLICY_RESOURCES
from agent.kube.errors import ApiError, NotFound
from agent.kube.informer import Informer, start_all
from agent.kube.rest import DEVICE_TAINT_RULES, PODS, RESOURCE_CLAIMS
from agent.names import ADMITTED_ANNOTATION, DELETE_PROTECTION, FENCE_RULE
from agent.objects.read import allocated_devices, claim_names
from fakes.cluster import FakeCluster, manifest, wait_for
from tests.bench.test_bench_node_prepare import percentile

PODS_TOTAL = 1000
QUEUES = 4


HOLD_GATE = "bench.gpu-dra-agent.io/hold"  # keeps the kube-scheduler case's pods back until their claims exist
CLIENT_QPS = 500
PERIOD_S = 0.05  # the arbiter's --period: its longest wait for a cycle (a change seen starts one sooner)
THRASH_S = 5.0  # an eviction this soon after the pod's admission, for a gang already waiting then: thrash


def _gangs(rng: random.Random) -> list[tuple[str, str, int]]:
    gangs: list[tuple[str, str, int]] = []
    left = PODS_TOTAL
    while left:
        size = min(left, rng.randint(1, 8))
        gangs.append((f"q{len(gangs) % QUEUES}", f"g{len(gangs)}", size))
        left -= size
    return gangs


def _claims_made(cluster: FakeCluster, pods: Informer, total: int, namespace: str | None = None) -> None:
    """Until `total` pods (of `namespace`, if given: an earlier run's may still be going) have their claim."""
    wait_for(
        lambda: (
            sum(
                1
                for p in pods.items()
                if len((p.get("status") or {}).get("resourceClaimStatuses") or ()) == 1
                and namespace in (None, p["metadata"]["namespace"])
            )
            >= total
        ),
        timeout=600,
        interval=0.2,
        what="claims from templates",
    )


class Kubelet:
    """Completes pods once bound to a node and confirms evictions: deletes with grace 0. As
    each node's kubelet would, it deletes pods in parallel (a worker per node): one thread deleting in turn
    would cap both schedulers' rates at its own, one API round trip per pod. A gang's pods (one PodGroup) are
    counted when bound but complete together once all of them are, as a gang's job ends: deleting the first
    bound ones while kube-scheduler still binds the rest would break the gang it is binding. It works from the
    pods informer's events (`seen`), not by polling: on this 2-core machine a harness scanning every pod every
    few milliseconds takes CPU from the schedulers it measures."""

    def __init__(self, cluster: FakeCluster, workers: int = 32) -> None:
        self._rest = cluster.rest
        self.completed: dict[str, float] = {}  # pod key -> when it was first seen bound
        self.ungated: dict[str, float] = {}  # pod key -> when it was first seen with no gate, not yet bound
        self.evicted: dict[str, float] = {}  # pod key -> when it was seen being deleted by someone else
        self._lock = threading.Lock()
        self._unbound: dict[str, set[str]] = {}  # gang (a pod alone: its key) -> its pods not bound yet
        self._bound: dict[str, set[str]] = {}  # gang -> its bound pods, not yet deleted
        self._deleting: set[str] = set()
        self._pool = futures.ThreadPoolExecutor(workers, thread_name_prefix="kubelet")

    def __enter__(self) -> Kubelet:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def seen(self, kind: str, pod: dict[str, Any]) -> None:
        """The pods informer's `on_event`."""
        meta, now = pod["metadata"], time.perf_counter()
        key = f"{meta['namespace']}/{meta['name']}"
        gang = _gang_of(pod) or key
        with self._lock:
            self._unbound.setdefault(gang, set()).discard(key)
            done: list[str] = []
            if kind == "DELETED":
                self._bound.get(gang, set()).discard(key)
            elif meta.get("deletionTimestamp"):
                self._bound.get(gang, set()).discard(key)
                if key not in self._deleting:
                    self.evicted.setdefault(key, now)
                    done.append(key)
            elif pod["spec"].get("nodeName"):
                self.completed.setdefault(key, now)
                if key not in self._deleting:
                    self._bound.setdefault(gang, set()).add(key)
            else:
                self._unbound[gang].add(key)
                if not pod["spec"].get("schedulingGates"):
                    self.ungated.setdefault(key, now)
            if not self._unbound[gang]:
                del self._unbound[gang]
                done.extend(self._bound.pop(gang, ()))
            self._deleting.update(done)
        for k in done:
            self._pool.submit(self._delete, k)

    def binding(self) -> str:
        """How long kube-scheduler took from a pod's last gate coming off to its binding."""
        waits = [self.completed[k] - at for k, at in self.ungated.items() if k in self.completed]
        return (
            f"ungated to bound a median {_p(waits, 50):.2f} s (p90 {_p(waits, 90):.2f}; {len(waits)} pods seen ungated)"
        )

    def _delete(self, key: str) -> None:
        namespace, name = key.split("/", 1)
        for _ in range(50):
            try:
                self._rest.delete(PODS, namespace, name, grace_period_s=0)
                return
            except NotFound:
                return
            except ApiError:
                time.sleep(0.1)  # refused (the server busy): again


def _gang_of(pod: dict[str, Any]) -> str | None:
    group = (pod["spec"].get("schedulingGroup") or {}).get("podGroupName")
    return f"{pod['metadata']['namespace']}/{group}" if group else None


class Occupancy:
    """Where a GPU's turn goes, from the claims informer's events: how long a claim holds its device (allocated
    until deleted), split at its pod's completion, and how long a device stays free between one claim's
    deletion and the next allocation on it. The rate is the GPUs held on average over the time a claim holds
    one, so the two say whether a scheduler is slow to fill GPUs or to get them back."""

    def __init__(self, cluster: FakeCluster, driver: str = "gpu.nvidia.com") -> None:
        self._claims = Informer(cluster.rest, RESOURCE_CLAIMS, on_event=self._seen)
        self._driver = driver
        self.allocated: dict[str, tuple[float, tuple[str, str]]] = {}  # claim uid -> (first seen held, device)
        self.gone: dict[str, float] = {}  # claim uid -> first seen deleted or free
        self.owner: dict[str, str] = {}  # claim uid -> its pod's key
        self._lock = threading.Lock()
        self._held = 0  # claims holding a device now
        self._since = 0.0  # since when `_held` has been what it is
        self._area = 0.0  # GPU-seconds held, from `_start`
        self._start = self._end = 0.0

    def __enter__(self) -> Occupancy:
        start_all([self._claims], 60)
        with self._lock:
            self._start = self._since = time.perf_counter()
            self._area = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self._claims.stop()
        with self._lock:
            self._end = time.perf_counter()
            self._area += self._held * (self._end - self._since)

    def _seen(self, kind: str, c: dict[str, Any]) -> None:
        m, now = c["metadata"], time.perf_counter()
        uid = m["uid"]
        devices = [] if kind == "DELETED" or m.get("deletionTimestamp") else allocated_devices(c, self._driver)
        with self._lock:
            before = self._held
            if devices and uid not in self.allocated:
                self.allocated[uid] = (now, devices[0])
                self.owner[uid] = f"{m['namespace']}/{(m.get('ownerReferences') or [{}])[0].get('name')}"
                self._held += 1
            elif not devices and uid in self.allocated and uid not in self.gone:
                self.gone[uid] = now
                self._held -= 1
            if self._held != before:
                self._area += before * (now - self._since)
                self._since = now

    def report(self, label: str, gpus: int, pod_done: dict[str, float]) -> str:
        """`pod_done`: pod key -> when the kubelet stand-in saw it bound."""
        done = {uid: pod_done[key] for uid, key in self.owner.items() if key in pod_done}
        holds = [gone - self.allocated[uid][0] for uid, gone in self.gone.items()]
        to_pod = [at - self.allocated[uid][0] for uid, at in done.items()]
        to_claim = [gone - done[uid] for uid, gone in self.gone.items() if uid in done]
        turns: dict[tuple[str, str], list[tuple[float, float | None]]] = {}  # device -> (held, gone), in order
        for uid, (at, device) in sorted(self.allocated.items(), key=lambda kv: kv[1][0]):
            turns.setdefault(device, []).append((at, self.gone.get(uid)))
        idle = [
            after - gone
            for t in turns.values()
            for (_, gone), (after, _) in itertools.pairwise(t)
            if gone is not None and after >= gone
        ]
        mean = self._area / max(1e-9, self._end - self._start)
        return (
            f"  {label}: GPUs held {mean:.0f} of {gpus} on average; a claim holds its GPU a median "
            f"{_p(holds, 50):.2f} s (p90 {_p(holds, 90):.2f}: from its allocation to its pod's completion "
            f"{_p(to_pod, 50):.2f} s, then to the claim's deletion {_p(to_claim, 50):.2f} s), a freed GPU waits "
            f"a median {_p(idle, 50):.2f} s (p90 {_p(idle, 90):.2f}) for its next claim"
        )


def _p(samples: list[float], q: float) -> float:
    return percentile(samples, q) if samples else float("nan")


@contextlib.contextmanager
def _claim_protection(cluster: FakeCluster) -> Iterator[None]:
    """The arbiter overlay's claim policy, as installed: new claims of our classes are made with their finalizer,
    so the arbiter does not write it. Yields once the server applies it (a real one does a moment after)."""
    docs = manifest("claim-protection.yaml")
    resources = {kind: r for kind, r in POLICY_RESOURCES if r.version == "v1"}
    for doc in docs:
        cluster.rest.create(resources[doc["kind"]], None, doc)
    cluster.namespace("probe")
    probe = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"generateName": "probe-", "namespace": "probe"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }

    def applied() -> bool:
        made = cluster.rest.create(RESOURCE_CLAIMS, "probe", probe)
        cluster.rest.delete(RESOURCE_CLAIMS, "probe", made["metadata"]["name"])  # the controller lets it go
        return DELETE_PROTECTION in (made["metadata"].get("finalizers") or ())

    wait_for(applied, timeout=30, interval=0.2, what="the claim policy applied")
    try:
        yield
    finally:
        for doc in reversed(docs):
            cluster.rest.delete(resources[doc["kind"]], None, doc["metadata"]["name"])


def _arbiter_run(cluster: FakeCluster, label: str, period_s: float, timed: _Timed | None = None) -> dict[str, float]:
    """The arbiter as deployed: its own process (`gpu-dra-agent arbiter`), so that this harness (the node
    agents, the kubelet stand-in, the informers) does not share its interpreter, as kube-scheduler does not.
    As kube-scheduler's case starts with kube-scheduler running and the pods' claims made, this one starts with
    the arbiter running, its fence in force, and the pods' claims made: the clock starts when their queues are
    created (until then every gang waits for its queue)."""
    rng = random.Random(7)
    gangs = _gangs(rng)
    kubelet = Kubelet(cluster)
    pods = Informer(cluster.rest, PODS, on_event=kubelet.seen)
    start_all([pods], 60)
    for q, name, size in gangs:
        cluster.gang(f"ns-{q}", name, q, pods=size, gpus=1)
    _claims_made(cluster, pods, PODS_TOTAL)
    log_path = cluster.root / "arbiter.log"
    with kubelet, open(log_path, "w") as log, Occupancy(cluster) as occupancy:
        proc = cluster.arbiter_process("--period", str(period_s), "--log-format", "json", stdout=None, stderr=log)
        try:
            wait_for(
                lambda: "arbiter running" in log_path.read_text(),
                timeout=120,
                interval=0.1,
                what="the arbiter running (its start puts the fence in place)",
            )
            time.sleep(ArbiterConfig().fence_settle_s + 0.5)  # the arbiter commits once the fence has settled
            start, cpu_before = time.perf_counter(), _cpu_seconds(proc.pid)
            if timed is not None:
                timed.start()
            cluster.queue("root")
            for i in range(QUEUES):
                cluster.queue(f"q{i}", parent="root", gpu_quota=64)
            wait_for(
                lambda: len(kubelet.completed) + len(kubelet.evicted) >= PODS_TOTAL and not pods.items(),
                timeout=900,
                interval=0.05,
                what="all admitted",
            )
            cpu = _cpu_seconds(proc.pid) - cpu_before
            if timed is not None:
                timed.stop()
                timed.used["arbiter"] = cpu
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait()
        admitted_at = dict(kubelet.completed)
        wall = max(admitted_at.values()) - start
    pods.stop()
    run = _read_log(log_path)
    rate = len(admitted_at) / wall
    print(f"\n{label}: 32 nodes x 8 GPUs, {PODS_TOTAL} pods in {len(gangs)} gangs of 1-8 across {QUEUES} queues:")
    evictions = sum(run.evictions.values())
    causes = ", ".join(f"{k} {v}" for k, v in sorted(run.evictions.items())) or "none"
    print(
        f"  admitted {len(admitted_at)} pods in {wall:.2f} s: {rate:.1f} pods/s gate to bound; "
        f"evictions {evictions} ({causes}; thrash {run.thrash})"
    )
    print(f"  arbiter CPU {cpu:.1f} s over {wall:.1f} s")
    print(occupancy.report("GPU turns", 256, admitted_at))
    print(f"  kube-scheduler binding the admitted pods: {kubelet.binding()}")
    print(
        f"  arbiter cycles {run.cycles} ({run.unchanged} started with no change seen); time in: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(run.seconds.items(), key=lambda kv: -kv[1]))
    )
    print(
        "  of which the cycle thread's CPU: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in sorted(run.cpu_seconds.items(), key=lambda kv: -kv[1]) if v >= 0.01)
    )
    print(
        "  the arbiter's CPU by thread, from its start: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in run.thread_cpu_seconds.items() if v >= 0.01)
    )
    print(f"  {_cpu_parts(run, len(admitted_at))}")
    print(
        f"  of which the garbage collector (agent.collector): {sum(run.gc_cpu_seconds) * 1000 / len(admitted_at):.2f}"
        f" ms a pod, {sum(run.gc_cpu_seconds):.3f} s in {sum(run.gc_collections)} collections (by generation, "
        f"youngest first: {' / '.join(f'{s:.3f} s' for s in run.gc_cpu_seconds)}; "
        f"{' / '.join(str(n) for n in run.gc_collections)})"
    )
    print(
        "  commit steps (summed over parallel commits): "
        + ", ".join(f"{k} {v:.2f} s" for k, v in run.commit_seconds.items())
    )
    print(
        "  their CPU a pod (the commits' own threads, the I/O threads' writes apart): "
        + ", ".join(f"{k} {v * 1000 / len(admitted_at):.2f} ms" for k, v in run.commit_cpu_seconds.items())
    )
    print(
        f"  commits refused {sum(run.refused.values())}"
        + "".join(f"\n    {n} x {reason}" for reason, n in sorted(run.refused.items(), key=lambda kv: -kv[1]))
    )
    print(f"  reservations kube-scheduler took from admitted pods, put back by the arbiter: {run.given_back}")
    return {"pods_s": rate, "evictions": evictions, "thrash": run.thrash}


# the arbiter's threads by what they do (agent.commands.arbiter.thread_cpu_seconds names them); any other is gRPC's
_PARTS = (
    ("the cycle (snapshot, decisions, recovery)", lambda name: name == "MainThread"),
    ("API writes (commit-io, events, queue-status)", lambda name: name in ("commit-io", "events", "queue-status")),
    ("gang commits (Reserve/Confirm calls, the writes built)", lambda name: name == "commit"),
    ("informers' decoding", lambda name: name.startswith("informer-")),
    ("gRPC's own threads", lambda name: True),
)


def _cpu_parts(run: _Run, pods: int) -> str:
    """The arbiter's CPU per admitted pod, by part, from its start; threads that ended meanwhile (gRPC starts
    and ends its own) are the process's total less its threads' at the end."""
    parts = dict.fromkeys([label for label, _ in _PARTS], 0.0)
    for name, seconds in run.thread_cpu_seconds.items():
        parts[next(label for label, matches in _PARTS if matches(name))] += seconds
    parts["the rest (threads ended meanwhile, gRPC threads counted in whole ticks)"] = max(
        0.0, run.process_cpu_seconds - sum(run.thread_cpu_seconds.values())
    )
    return (
        f"the arbiter's CPU per admitted pod, from its start: {run.process_cpu_seconds * 1000 / pods:.2f} ms ("
        + ", ".join(f"{label} {seconds * 1000 / pods:.2f}" for label, seconds in parts.items())
        + ")"
    )


class _Timed:
    """The CPU spent while a run is timed, by process (`processes()`: CPU seconds so far of each) and by the whole
    machine (/proc/stat): on this 2-core VM every process shares the CPU, so the rate follows the CPU per pod."""

    def __init__(self, processes: Callable[[], dict[str, float]]) -> None:
        self._processes = processes
        self._before: dict[str, float] = {}
        self._at = 0.0
        self._jiffies = (0, 0)
        self.seconds = 0.0
        self.used: dict[str, float] = {}  # process -> CPU seconds while timed
        self.busy = 0.0  # the machine's CPUs busy while timed, 0-1

    def start(self) -> None:
        self._before, self._at, self._jiffies = self._processes(), time.perf_counter(), _jiffies()

    def stop(self) -> None:
        after, (total, idle) = self._processes(), _jiffies()
        self.seconds = time.perf_counter() - self._at
        self.used = {k: v - self._before.get(k, 0.0) for k, v in after.items()}
        self.busy = 1 - (idle - self._jiffies[1]) / max(1, total - self._jiffies[0])

    def report(self, label: str, pods: int) -> str:
        used = {k: v * 1000 / pods for k, v in self.used.items()}
        return (
            f"CPU while timed, {label}: {sum(used.values()):.1f} ms a pod over {self.seconds:.1f} s, the "
            f"machine's {os.cpu_count()} CPUs {self.busy:.0%} busy ("
            + ", ".join(f"{k} {v:.1f}" for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v >= 0.05)
            + ")"
        )


def _jiffies() -> tuple[int, int]:
    """The machine's CPU time so far, all and idle (with I/O wait), in clock ticks."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def _cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class _Run:
    cycles: int
    evictions: dict[str, int]
    seconds: dict[str, float]
    cpu_seconds: dict[str, float]  # the cycle thread's own CPU per phase
    commit_seconds: dict[str, float]
    commit_cpu_seconds: dict[str, float]  # CPU per step: the commits' threads', and the I/O threads' writes
    thread_cpu_seconds: dict[str, float]  # the arbiter's CPU by thread (commit workers summed), once running
    process_cpu_seconds: float  # the arbiter's whole CPU over the same span
    thrash: int
    refused: dict[str, int]  # commits a node or the API refused, by reason (the gang waits for the next cycle)
    given_back: int  # reservations kube-scheduler took from admitted pods, which the arbiter put back
    unchanged: int = 0  # cycles started by the period alone, no change seen since the last one
    gc_cpu_seconds: list[float] = dataclasses.field(default_factory=lambda: [0.0, 0.0, 0.0])  # by generation
    gc_collections: list[int] = dataclasses.field(default_factory=lambda: [0, 0, 0])


_ADMITTED = re.compile(r"admitted gang (\S+) of queue")
_EVICTED = re.compile(r"evicted \S+ \(gang (\S+), queue")
_REFUSED = re.compile(r"gang \S+ not committed: (.*)")
_GIVEN_BACK = re.compile(r"kube-scheduler took \S+ out of the reservedFor")


def _read_log(path: Path) -> _Run:
    """The arbiter's JSON log: its closing summary, and thrash (every gang waited from the start, so an eviction
    within THRASH_S of its gang's admission is thrash)."""
    admitted: dict[str, float] = {}
    thrash = 0
    summary: dict[str, Any] = {}
    refused: dict[str, int] = {}
    given_back = 0
    for line in path.read_text().splitlines():
        if not line.startswith("{"):
            continue
        entry = json.loads(line)
        at = datetime.fromisoformat(entry["ts"]).timestamp()
        if m := _ADMITTED.match(entry["msg"]):
            admitted.setdefault(m[1], at)
        elif (m := _EVICTED.match(entry["msg"])) and m[1] in admitted and at - admitted[m[1]] < THRASH_S:
            thrash += 1
        elif m := _REFUSED.match(entry["msg"]):
            reason = re.sub(r"\S*\d\S*", "#", m[1])[:60]  # names and numbers out: one line per kind
            refused[reason] = refused.get(reason, 0) + 1
        elif _GIVEN_BACK.match(entry["msg"]):
            given_back += 1
        elif entry["msg"] == "arbiter stopped":
            summary = entry
    assert summary, f"the arbiter wrote no summary: see {path}"
    return _Run(
        summary["cycles"],
        summary["evictions"],
        summary["seconds"],
        summary["cpu_seconds"],
        summary["commit_seconds"],
        summary.get("commit_cpu_seconds", {}),
        summary.get("thread_cpu_seconds", {}),
        summary.get("process_cpu_seconds", 0.0),
        thrash,
        refused,
        given_back,
        summary.get("unchanged_cycles", 0),
        summary.get("gc_cpu_seconds", [0.0, 0.0, 0.0]),
        summary.get("gc_collections", [0, 0, 0]),
    )


def _kube_scheduler_run(cluster: FakeCluster, timed: _Timed) -> float:
    """The same number of pods, 1 GPU each, no queue, no gang: kube-scheduler allocates and binds them. Held
    back by a gate of ours until their claims exist, then released all at once (8 writers)."""
    cluster.rest.delete(DEVICE_TAINT_RULES, None, FENCE_RULE)  # no arbiter: kube-scheduler allocates
    kubelet = Kubelet(cluster)
    pods = Informer(cluster.rest, PODS, on_event=kubelet.seen)
    start_all([pods], 60)
    cluster.namespace("plain")
    with futures.ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: cluster.pod("plain", f"p{i}", None, 1, gated=False, gates=[HOLD_GATE]), range(PODS_TOTAL)
            )
        )
    _claims_made(cluster, pods, PODS_TOTAL, "plain")

    def release(p: dict[str, Any]) -> None:
        body = copy.deepcopy(p)
        body["spec"]["schedulingGates"] = []
        with contextlib.suppress(ApiError):
            cluster.rest.replace(PODS, body)

    with kubelet, Occupancy(cluster) as occupancy:
        start = time.perf_counter()
        timed.start()
        with futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(release, pods.items()))
        wait_for(lambda: len(kubelet.completed) >= PODS_TOTAL, timeout=900, interval=0.05, what="all bound")
        timed.stop()
        wall = max(kubelet.completed.values()) - start
    pods.stop()
    rate = PODS_TOTAL / wall
    print(
        f"kube-scheduler: {PODS_TOTAL} pods of 1 GPU from a template, no gangs: {wall:.2f} s, {rate:.1f} pods/s "
        "ungate to bound"
    )
    print(occupancy.report("GPU turns", 256, kubelet.completed))
    print(f"  kube-scheduler allocating and binding: {kubelet.binding()}")
    return rate


_SAMPLE = re.compile(r"^apiserver_request_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _api_writes(cp: Any) -> dict[str, float]:
    """The API server's own count of the writes it served (apiserver_request_total), by resource and verb, and
    by status code where it refused one."""
    request = urllib.request.Request(cp.url + "/metrics")
    with urllib.request.urlopen(request, context=cp.ssl_context(), timeout=30) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        labels = dict(_LABEL.findall(m["labels"]))
        if labels.get("verb") not in ("POST", "PUT", "PATCH", "DELETE", "APPLY"):
            continue
        key = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
        key += f" {labels['verb']}"
        if not labels.get("code", "2").startswith("2"):
            key += f" {labels['code']}"  # refused (a conflict, say): a write that must be done again
        out[key] = out.get(key, 0.0) + float(m["value"])
    return out


def _cpu_by_process(cp: Any) -> dict[str, float]:
    """CPU seconds so far of each control-plane process and of this one (the node agents, the kubelet stand-in,
    the informers; the arbiter runs in a process of its own, counted by _arbiter_run)."""
    own = os.times()
    out = {c.name: _cpu_seconds(c.process.pid) for c in cp.components if c.process.poll() is None}
    out["bench (node agents, kubelet stand-in)"] = own.user + own.system
    return out


def _ceiling_run(cluster: FakeCluster, workers: int) -> float:
    """The arbiter's writes per pod (claim status with allocation and reservedFor, pod ungated, and the claim's
    finalizer where the claim policy did not put it on) by a minimal client at the arbiter's commit concurrency,
    nothing else: what the API allows."""
    pods = Informer(cluster.rest, PODS)
    claims = Informer(cluster.rest, RESOURCE_CLAIMS)
    start_all([pods, claims], 60)
    cluster.queue("ceiling")
    for i in range(PODS_TOTAL):
        cluster.pod("ceiling", f"c{i}", "ceiling", 1)
    _claims_made(cluster, pods, PODS_TOTAL, "ceiling")
    wait_for(
        lambda: sum(1 for c in claims.items() if c["metadata"]["namespace"] == "ceiling") >= PODS_TOTAL,
        timeout=120,
        interval=0.1,
        what="the claims in the ceiling's informer",
    )
    cluster.rest.create(
        DEVICE_TAINT_RULES,
        None,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceTaintRule",
            "metadata": {"name": FENCE_RULE},
            "spec": {
                "deviceSelector": {"driver": "gpu.nvidia.com"},
                "taint": {"key": "scheduling.gpu-dra-agent.io/arbiter", "effect": "NoSchedule"},
            },
        },
    )
    nodes = sorted(cluster.agents)

    def commit(i_pod: tuple[int, dict[str, Any]]) -> None:
        i, pod = i_pod
        node, device = nodes[(i // 8) % len(nodes)], f"gpu-{i % 8}"
        (name,), _ = claim_names(pod)
        claim = copy.deepcopy(claims.get("ceiling", name))
        assert claim is not None
        if DELETE_PROTECTION not in (claim["metadata"].get("finalizers") or ()):  # made without the policy
            claim["metadata"]["finalizers"] = [DELETE_PROTECTION]
            claim = cluster.rest.replace(RESOURCE_CLAIMS, claim)
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [{"request": "gpus", "driver": "gpu.nvidia.com", "pool": node, "device": device}]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}],
        }
        cluster.rest.replace(RESOURCE_CLAIMS, claim, "status")
        body = copy.deepcopy(pod)
        body["spec"]["schedulingGates"] = []
        body["spec"]["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                    ]
                }
            }
        }
        body["metadata"].setdefault("annotations", {})[ADMITTED_ANNOTATION] = "2026-01-01T00:00:00Z"
        cluster.rest.replace(PODS, body)

    start = time.perf_counter()
    with futures.ThreadPoolExecutor(workers) as pool:
        # this run's pods only: the kube-scheduler run's may still be going
        list(pool.map(commit, enumerate(p for p in pods.items() if p["metadata"]["namespace"] == "ceiling")))
    wall = time.perf_counter() - start
    pods.stop()
    claims.stop()
    rate = PODS_TOTAL / wall
    print(f"ceiling: the arbiter's writes, a minimal client, {workers} at once: {wall:.2f} s, {rate:.1f} pods/s")
    return rate


@pytest.mark.bench
@pytest.mark.controlplane
@pytest.mark.timeout(3600)
def test_admission_on_the_real_control_plane(control_plane_binaries: Any) -> None:
    from tests.controlplane.cluster import ControlPlane

    config = ArbiterConfig()
    with ControlPlane(control_plane_binaries, client_qps=CLIENT_QPS).start() as cp:
        path = cp.write_kubeconfig(cp.workdir / "bench.kubeconfig")
        with FakeCluster(nodes=32, kubeconfig=path, make_node=cp.add_node) as cluster:
            print(
                f"\nreal control plane 1.37, kube-controller-manager and kube-scheduler --kube-api-qps="
                f"{CLIENT_QPS} --kube-api-burst={2 * CLIENT_QPS}; arbiter (its own process) client unlimited, "
                f"{config.commit_workers} gangs committed at once"
            )
            timed_arbiter, timed_scheduler = _Timed(lambda: _cpu_by_process(cp)), _Timed(lambda: _cpu_by_process(cp))
            before = _api_writes(cp)
            with _claim_protection(cluster):  # the arbiter as installed; kube-scheduler's path, as without us
                arbiter = _arbiter_run(cluster, "arbiter", PERIOD_S, timed_arbiter)
            between = _api_writes(cp)
            scheduler = _kube_scheduler_run(cluster, timed_scheduler)
            after = _api_writes(cp)
            with _claim_protection(cluster):
                ceiling = _ceiling_run(cluster, config.commit_workers)
    # the API server's writes are what both paths share on one control plane: per pod, by whom they are for
    for label, start, end in (("arbiter path", before, between), ("kube-scheduler path", between, after)):
        delta = {k: (end[k] - start.get(k, 0.0)) / PODS_TOTAL for k in end if end[k] > start.get(k, 0.0)}
        print(
            f"API writes per pod, {label}: {sum(delta.values()):.2f} ("
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(delta.items(), key=lambda kv: -kv[1]) if v >= 0.05)
            + ")"
        )
    # the machine's CPU is what both paths share too: per pod, by process, while each was timed
    print(timed_arbiter.report("arbiter path", PODS_TOTAL))
    print(timed_scheduler.report("kube-scheduler path", PODS_TOTAL))
    arbiter_ms = timed_arbiter.used.get("arbiter", 0.0) * 1000 / PODS_TOTAL
    scheduler_ms = timed_scheduler.used.get("kube-scheduler", 0.0) * 1000 / PODS_TOTAL
    print(
        f"CPU per pod (same run): the arbiter {arbiter_ms:.2f} ms per admitted pod; kube-scheduler "
        f"{scheduler_ms:.2f} ms per pod it allocates and binds, "
        f"{timed_arbiter.used.get('kube-scheduler', 0.0) * 1000 / PODS_TOTAL:.2f} ms per admitted pod it binds"
    )
    print(
        f"side by side (same run, same nodes): arbiter {arbiter['pods_s']:.1f} pods/s "
        f"({arbiter['evictions']:.0f} evictions, thrash {arbiter['thrash']:.0f}), kube-scheduler "
        f"{scheduler:.1f} pods/s, ceiling {ceiling:.1f} pods/s; arbiter / kube-scheduler "
        f"{arbiter['pods_s'] / scheduler:.2f}, arbiter / ceiling {arbiter['pods_s'] / ceiling:.2f}"
    )
    assert arbiter["thrash"] == 0


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_admission_through_the_api() -> None:
    with FakeCluster(nodes=32, apiserver_process=True) as cluster, _claim_protection(cluster):
        out = _arbiter_run(cluster, "arbiter, API fake", PERIOD_S)
    assert out["thrash"] == 0
