"""Trace replay of the FGD paper's experiment: arrival-only placement, unallocated GPU share at a load level.

One seed drives a run: it shuffles the pods, scales the workload to 1.3x the GPU capacity, draws the node
order that settles ties, and feeds the random choices. Pods arrive one by one and never leave; a pod that
fits nowhere is dropped but counts as arrived. The measure at level L is the mean allocated share over the
arrivals where the arrived share rounds to L (shared/reference/openb-protocol.md).

Speed: a node's score depends only on its state and the pod's spec, so scores are cached per spec and
recomputed only for the nodes changed since that spec was last seen, and memoised per (state, spec).
"""

from __future__ import annotations

import random
import statistics
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from agent.allocation.fragmentation import MILLI, RequestKind, RequestMix
from agent.simulation.trace_policies import NodeView, Policy, TracePod, baseline_policies, fits

WORKLOAD_SCALE = 1.3
TIE_REGIMES = ("fixed", "random")
NO_FIT = -(1 << 62)  # below any policy's score (near's can be negative)
PAPER_SEEDS = tuple(range(42, 52))


@dataclass(frozen=True)
class TraceNode:
    name: str
    cpu_milli: int
    memory_mib: int
    gpu_count: int
    model: str

    def empty(self) -> NodeView:
        return NodeView(self.model, self.cpu_milli, self.memory_mib, (MILLI,) * self.gpu_count)


def gpu_capacity(nodes: Iterable[TraceNode]) -> int:
    return sum(n.gpu_count for n in nodes) * MILLI


def typical_mix(pods: Iterable[TracePod], coverage: float = 0.95) -> RequestMix:
    """FGD's expected mix from the original trace: (CPU, #GPU, milli, models) kinds covering 95%."""
    return RequestMix.typical((RequestKind(p.cpu_milli, p.gpu_count, p.gpu_milli, p.models) for p in pods), coverage)


def build_workload(
    pods: Sequence[TracePod], capacity_milli: int, rng: random.Random, scale: float = WORKLOAD_SCALE
) -> list[TracePod]:
    """Shuffle the trace, then append random copies (or drop random pods) to reach `scale` x capacity."""
    if not pods:
        raise ValueError("the pod list is empty")
    by_name = sorted(pods, key=lambda p: p.name)
    workload = list(by_name)
    rng.shuffle(workload)
    target = scale * capacity_milli
    total = sum(p.total_gpu_milli for p in workload)
    if total < target:
        while True:
            extra = rng.choice(by_name)
            # the simulator checks the per-GPU milli, not the pod's total: kept for fidelity
            if total + extra.gpu_milli > target:
                break
            workload.append(extra)
            total += extra.total_gpu_milli
    else:
        while total > target and workload:
            total -= workload.pop(rng.randrange(len(workload))).total_gpu_milli
    return workload


def stable_order(nodes: Sequence[TraceNode]) -> list[int]:
    """A node order that is the same in every run and unrelated to names' sorting: by CRC32 of the name."""
    return sorted(range(len(nodes)), key=lambda i: (zlib.crc32(nodes[i].name.encode()), nodes[i].name))


@dataclass
class RunResult:
    unallocated_percent: float
    placed: int
    dropped: int
    allocated_levels: dict[int, list[float]] = field(repr=False, default_factory=dict)


class _Cluster:
    """Node states and per-spec score arrays of one run.

    Each distinct node state gets a small integer id when it first appears, so memoised scores are looked
    up by two integers instead of hashing a node's whole state on every lookup.
    """

    def __init__(self, nodes: Sequence[TraceNode], policy: Policy) -> None:
        self.views = [n.empty() for n in nodes]
        self.policy = policy
        self._state_ids: dict[NodeView, int] = {}
        self._states: list[NodeView] = []
        self.state_of = [self._intern(v) for v in self.views]  # node index -> state id
        self.changes: list[int] = []  # node index per placement, in order
        self._spec_ids: dict[tuple[object, ...], int] = {}
        self.scores: dict[int, tuple[npt.NDArray[np.int64], int]] = {}
        self.memo: dict[int, int] = {}

    def _intern(self, view: NodeView) -> int:
        state = self._state_ids.get(view)
        if state is None:
            state = self._state_ids[view] = len(self._states)
            self._states.append(view)
        return state

    def _score(self, state: int, pod: TracePod, spec: int) -> int:
        key = state << 32 | spec
        s = self.memo.get(key)
        if s is None:
            view = self._states[state]
            s = self.policy.score(view, pod) if fits(view, pod) else NO_FIT
            self.memo[key] = s
        return s

    def scores_for(self, pod: TracePod) -> npt.NDArray[np.int64]:
        spec = self._spec_ids.setdefault(pod.spec, len(self._spec_ids))
        cached = self.scores.get(spec)
        n = len(self.views)
        if cached is None or len(self.changes) - cached[1] >= n:
            # score each distinct state once, then spread the scores over the nodes in that state
            states, where = np.unique(np.array(self.state_of, dtype=np.int64), return_inverse=True)
            per_state = np.fromiter((self._score(int(s), pod, spec) for s in states), dtype=np.int64, count=len(states))
            arr = per_state[where]
        else:
            arr = cached[0]
            for i in set(self.changes[cached[1] :]):
                arr[i] = self._score(self.state_of[i], pod, spec)
        self.scores[spec] = (arr, len(self.changes))
        return arr

    def place(self, i: int, pod: TracePod, gpus: tuple[int, ...]) -> None:
        v = self.views[i]
        free = list(v.gpu_free)
        for g in gpus:
            free[g] -= pod.gpu_milli
            if free[g] < 0:
                raise AssertionError(f"GPU {g} of node {i} over-allocated")
        tags = v.tags | {pod.tag} if pod.tag else v.tags
        self.views[i] = NodeView(v.model, v.cpu_free - pod.cpu_milli, v.memory_free - pod.memory_mib, tuple(free), tags)
        self.state_of[i] = self._intern(self.views[i])
        self.changes.append(i)


def replay_once(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    policy: Policy,
    seed: int,
    *,
    ties: str = "fixed",
    level: int = 100,
) -> RunResult:
    """One seeded run of one policy; the unallocated GPU % when the arrived workload reaches `level`%."""
    if ties not in TIE_REGIMES:
        raise ValueError(f"unknown tie regime {ties!r}: use one of {', '.join(TIE_REGIMES)}")
    rng = random.Random(seed)  # noqa: S311 - a seeded simulation, not security
    capacity = gpu_capacity(nodes)
    if capacity == 0:
        raise ValueError("the node list has no GPUs")
    workload = build_workload(pods, capacity, rng)
    n = len(nodes)
    order = list(range(n))
    rng.shuffle(order)  # the run's fixed node order: the simulator's random name prefix
    rank = np.empty(n, dtype=np.int64)
    rank_of = order if policy.tie_rule == "regime" else stable_order(nodes)
    rank[np.array(rank_of)] = np.arange(n - 1, -1, -1)  # higher = preferred among equals
    cluster = _Cluster(nodes, policy)
    near = policy.tie_rule == "near"
    in_use = np.zeros(n, dtype=np.int64)  # near: 1 once the node holds a GPU pod (pods never leave)
    arrived = used = placed = dropped = 0
    levels: dict[int, list[float]] = {}
    for pod in workload:
        scores = cluster.scores_for(pod)
        best = int(scores.max())
        if best == NO_FIT:
            dropped += 1
        else:
            if policy.tie_rule == "uniform" or (policy.tie_rule == "regime" and ties == "random"):
                tied = np.flatnonzero(scores == best)
                i = int(tied[rng.randrange(len(tied))])
            elif near:
                close = scores >= best - policy.window(pod)
                i = int(np.argmax(np.where(close, in_use * n + rank, -1)))
            else:
                i = int(np.argmax(np.where(scores == best, rank, -1)))
            gpus = policy.choose_gpus(cluster.views[i], pod, rng)
            cluster.place(i, pod, gpus)
            if near:
                in_use[i] = cluster.views[i].in_use
            used += pod.total_gpu_milli
            placed += 1
        arrived += pod.total_gpu_milli
        arrived_pct = (200 * arrived + capacity) // (2 * capacity)  # round half up
        levels.setdefault(arrived_pct, []).append(round(100 * used / capacity, 2))
    at_level = levels.get(level)
    if not at_level:
        raise ValueError(f"the workload never reached {level}% of the GPU capacity")
    return RunResult(100 - statistics.fmean(at_level), placed, dropped, levels)


def replay_run(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    mix: RequestMix,
    policy: str,
    seed: int,
    *,
    ties: str = "fixed",
) -> float:
    """Unallocated GPU % of one seeded run of the named policy, built afresh: its memos live for this run only
    (kept across runs they grow by gigabytes over a family of lists and seeds)."""
    return replay_once(nodes, pods, baseline_policies(mix)[policy], seed, ties=ties).unallocated_percent


def replay(
    nodes: Sequence[TraceNode],
    pods: Sequence[TracePod],
    policy_names: Sequence[str],
    seeds: Sequence[int] = PAPER_SEEDS,
    ties: str = "fixed",
) -> dict[str, list[float]]:
    """Unallocated GPU % per seed for each named policy, all on the same workloads."""
    mix = typical_mix(pods)
    known = baseline_policies(mix)
    unknown = [p for p in policy_names if p not in known]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(unknown)}: choose from {', '.join(known)}")
    return {name: [replay_run(nodes, pods, mix, name, s, ties=ties) for s in seeds] for name in policy_names}


def parse_nodes(rows: Iterable[dict[str, str]]) -> list[TraceNode]:
    """Rows of a node CSV (sn,cpu_milli,memory_mib,gpu,model)."""
    nodes = []
    for r in rows:
        try:
            node = TraceNode(r["sn"], int(r["cpu_milli"]), int(r["memory_mib"]), int(r["gpu"]), r.get("model") or "")
        except (KeyError, ValueError) as e:
            raise ValueError(f"bad node row: {e}: expected columns sn,cpu_milli,memory_mib,gpu,model") from e
        if min(node.cpu_milli, node.memory_mib, node.gpu_count) < 0:
            raise ValueError(f"bad node row {node.name!r}: negative cpu_milli, memory_mib or gpu")
        nodes.append(node)
    return nodes


def parse_pods(rows: Iterable[dict[str, str]]) -> list[TracePod]:
    """Rows of a pod CSV; gpu_milli is clamped to 1000 and ignored without GPUs, gpu_spec is `A|B`."""
    pods = []
    for r in rows:
        try:
            count = int(r["num_gpu"])
            milli = min(int(r["gpu_milli"] or 0), MILLI) if count else 0
            spec = (r.get("gpu_spec") or "").strip()
            models = tuple(sorted(m for m in spec.split("|") if m)) if count else ()
            pod = TracePod(r["name"], int(r["cpu_milli"]), int(r["memory_mib"]), count, milli, models)
        except (KeyError, ValueError) as e:
            raise ValueError(f"bad pod row {r.get('name', '?')!r}: {e}") from e
        if count < 0 or milli < 0 or (count and milli == 0):
            raise ValueError(f"bad pod row {r['name']!r}: GPU request {count} x {milli} milli")
        if pod.cpu_milli < 0 or pod.memory_mib < 0:
            raise ValueError(f"bad pod row {r['name']!r}: negative cpu_milli or memory_mib")
        pods.append(pod)
    return pods
