"""Scale benchmark: one full arbiter cycle on large synthetic snapshots (opt-in: `make bench`).

1,000 nodes x 8 GPUs, 50 queues in two levels, 4,000 running and 10,000 pending pods in gangs of 1-16
(target: under 1 s), then 4,000 nodes and 140,000 pods (KAI reports 2.35-2.5 s per cycle in Go; issue 18's
goal: under 0.6 s): 24,000 running (75% of the 32,000 GPUs) and 116,000 pending. Wall-clock times: on a shared
machine run it two or three times.

Each figure is printed beside a baseline's, measured back to back on the same snapshot: the arbiter core of the git
ref `ARBITER_BASELINE` (default `main`; `none` skips it), extracted with `git archive`: sources only, so the
baseline runs interpreted, and this tree compiled where `make compiled` has built it. With a baseline, both sides
run in fresh subprocesses, one after the other: a process that has already run cycles is measurably slower.
The `decisions` row is a digest of every pod's decision, so the two columns show whether the decisions agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.arbiter.core.cycle import ACTIONS, CycleResult, gc_paused, run_cycle
from agent.arbiter.core.model import (
    MILLI,
    JobSpec,
    NodeSpec,
    Placement,
    PodSpec,
    QueueSpec,
    ResourceTerms,
    Snapshot,
)
from agent.arbiter.core.session import Session

GIB = 1024**3


def synthetic(nodes: int, running: int, pending: int, seed: int = 1) -> Snapshot:
    """Nodes of 8 GPUs; 5 departments x 10 teams; gangs of 1-16 one-GPU pods (some pods share a GPU)."""
    rng = random.Random(seed)
    node_specs = tuple(
        NodeSpec(
            f"node-{i}", 8, 128_000, 1024 * GIB, "H100", {"pool": "a" if i % 2 else "b"}, ((0, 1, 2, 3), (4, 5, 6, 7))
        )
        for i in range(nodes)
    )
    gpus = nodes * 8
    queues: list[QueueSpec] = []
    for d in range(5):
        queues.append(QueueSpec(f"dept-{d}", None, 100, _terms(gpus / 5, 1 + d % 2)))
        for t in range(9):
            queues.append(QueueSpec(f"team-{d}-{t}", f"dept-{d}", 100 + t % 3, _terms(gpus / 50, 1 + t % 2)))
    leaves = [q.name for q in queues if q.parent is not None]
    jobs: list[JobSpec] = []
    used = [0] * nodes  # whole GPUs used per node, to place running gangs
    cursor = 0
    placed = 0
    while placed < running:
        size = min(rng.randint(1, 16), running - placed)
        pods = []
        for k in range(size):
            while used[cursor] == 8:
                cursor += 1
            pods.append(PodSpec(f"r{len(jobs)}-{k}", MILLI, 4000, 32 * GIB, "Running", f"node-{cursor}"))
            used[cursor] += 1
        jobs.append(_job(rng, f"r{len(jobs)}", rng.choice(leaves), tuple(pods), size))
        placed += size
    queued = 0
    while queued < pending:
        size = min(rng.randint(1, 16), pending - queued)
        share = rng.random() < 0.1
        waiting = tuple(PodSpec(f"p{len(jobs)}-{k}", 500 if share else MILLI, 4000, 32 * GIB) for k in range(size))
        jobs.append(_job(rng, f"p{len(jobs)}", rng.choice(leaves), waiting, max(1, size - rng.randint(0, 2))))
        queued += size
    return Snapshot(node_specs, tuple(queues), tuple(jobs))


def _terms(gpu_quota: float, weight: float) -> tuple[ResourceTerms, ResourceTerms, ResourceTerms]:
    return (ResourceTerms(gpu_quota * MILLI, -1, weight), ResourceTerms(), ResourceTerms())


def _job(rng: random.Random, name: str, queue: str, pods: tuple[PodSpec, ...], min_member: int) -> JobSpec:
    priority = rng.choice((50, 50, 50, 75, 125))
    return JobSpec(name, queue, priority, priority < 100, min_member, 1.7e9 + rng.random() * 1e5, pods)


def _cycle(snapshot: Snapshot) -> dict[str, float]:
    """One cycle as `run_cycle` runs it (garbage collection paused), timed per phase; then the collection the
    pause put off, which a long-running arbiter pays between cycles."""
    times: dict[str, float] = {}
    gc.collect()
    with gc_paused():
        start, cpu_start = time.perf_counter(), time.thread_time()
        session = Session(snapshot)
        times["session (snapshot + fair share)"] = time.perf_counter() - start
        for name in ("allocate", "consolidate", "reclaim", "preempt"):
            t = time.perf_counter()
            ACTIONS[name](session)
            times[name] = time.perf_counter() - t
        times["total"] = time.perf_counter() - start
        times["total, CPU"] = time.thread_time() - cpu_start
    bound = sum(1 for p in session.pods if p.state in ("bound", "pipelined"))
    evicted = sum(1 for p in session.pods if p.state == "evicted")
    del session
    t = time.perf_counter()
    gc.collect()
    times["collection after the cycle"] = time.perf_counter() - t
    t = time.perf_counter()
    result = run_cycle(snapshot)  # as `simulate` times it: with the decisions and the next round's snapshot
    times["run_cycle (simulate's cycleSeconds)"] = time.perf_counter() - t
    # the next cycle, one pod more, as a cycle built whole (run_cycle) and from the last cycle's session
    # (CycleCache): first right after the cycle over the same snapshot (its decisions not carried out, so the
    # actions redo them all), then in a running arbiter's steady state: the world at rest (decisions carried out
    # round after round until a round changes a few hundred pods), a cycle over it, then one pod more
    arrive = _arrival(snapshot)
    t, cpu = time.perf_counter(), time.thread_time()
    whole = run_cycle(arrive)
    times["run_cycle after one pod arrives"] = time.perf_counter() - t
    times["run_cycle after one pod arrives, CPU"] = time.thread_time() - cpu
    try:
        from agent.arbiter.core.incremental import CycleCache
    except ImportError:  # a baseline from before it
        return {**times, **_summary(bound, evicted, result)}
    cache = CycleCache()
    cache.run(snapshot)
    gc.collect()
    cpu = time.thread_time()
    reused = cache.run(arrive)
    times["incremental after one pod arrives, CPU"] = time.thread_time() - cpu
    assert not cache.rebuilt and reused.pods == whole.pods and reused.evictions == whole.evictions
    rest = result.next
    for _ in range(REST_ROUNDS - 1):
        rest = run_cycle(rest).next
    steady = _arrival(rest)
    # each side three times in turn, the least kept: a single cycle of a process that has run many varies by half
    full: list[tuple[float, float]] = []
    reused_cpu: list[tuple[float, float]] = []
    with _actions_timed() as actions:
        for _ in range(3):
            gc.collect()
            cpu = time.thread_time()
            whole = run_cycle(steady)
            full.append((time.thread_time() - cpu, actions.pop()))
            cache.run(rest)
            actions.pop()
            gc.collect()
            cpu = time.thread_time()
            reused = cache.run(steady)
            reused_cpu.append((time.thread_time() - cpu, actions.pop()))
            assert not cache.rebuilt and reused.pods == whole.pods and reused.evictions == whole.evictions
    times["at rest, then one pod: run_cycle, CPU"], times["  its actions (run_cycle), CPU"] = min(full)
    times["at rest, then one pod: incremental, CPU"], times["  its actions (incremental), CPU"] = min(reused_cpu)
    times["at rest, then one pod: incremental / full"] = (
        times["at rest, then one pod: incremental, CPU"] / times["at rest, then one pod: run_cycle, CPU"]
    )
    return {**times, **_summary(bound, evicted, result)}


REST_ROUNDS = 3  # the synthetic world is at rest after three rounds: each later one moves 250-400 of 140,000 pods


class _ActionsTimer:
    """CPU seconds the cycle's actions took since the last `pop` (the rest of a cycle: its session and result)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def pop(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@contextlib.contextmanager
def _actions_timed() -> Iterator[_ActionsTimer]:
    timer = _ActionsTimer()
    saved = dict(ACTIONS)

    def timed(action: Callable[[Session], None]) -> Callable[[Session], None]:
        def run(session: Session) -> None:
            cpu = time.thread_time()
            action(session)
            timer.seconds += time.thread_time() - cpu

        return run

    ACTIONS.update({name: timed(action) for name, action in saved.items()})
    try:
        yield timer
    finally:
        ACTIONS.update(saved)


def _arrival(snapshot: Snapshot) -> Snapshot:
    """`snapshot` with one gang of one pod more, waiting."""
    pod = PodSpec("arrived-0", MILLI, 4000, 32 * GIB)
    job = JobSpec("arrived", snapshot.jobs[-1].queue, 50, True, 1, 1.8e9, (pod,))
    return dataclasses.replace(snapshot, jobs=(*snapshot.jobs, job))


def _summary(bound: int, evicted: int, result: CycleResult) -> dict[str, float]:
    return {
        "pods placed": bound,
        "pods evicted": evicted,
        "decisions": int(hashlib.sha256(repr(sorted(result.pods.items())).encode()).hexdigest()[:8], 16),
    }


ROOT = Path(__file__).resolve().parents[2]
_BASELINE_RUN = """
import dataclasses, importlib.util, json, sys
sys.path.insert(0, sys.argv[1])
spec = importlib.util.spec_from_file_location("scale_bench", sys.argv[2])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
from agent.arbiter.core import cycle
from agent.arbiter.core.model import Placement
assert cycle.__file__.startswith(sys.argv[1]), cycle.__file__
nodes, running, pending = (int(a) for a in sys.argv[3:6])
snapshot = dataclasses.replace(bench.synthetic(nodes, running, pending), placement=Placement(gpu=sys.argv[6]))
print(json.dumps(bench._cycle(snapshot)))
"""


def _baseline_tree(tmp: Path) -> tuple[str, Path] | None:
    """The baseline ref's `agent` package extracted under `tmp`, or None (no such ref, or `none`)."""
    ref = os.environ.get("ARBITER_BASELINE", "main")
    if ref == "none":
        return None
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", ref, "agent"], capture_output=True, check=False
    )
    if archive.returncode != 0:
        print(f"\nno baseline: git archive {ref}: {archive.stderr.decode().strip()}")
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    return ref, tmp


def _cycle_in_subprocess(tree: Path, nodes: int, running: int, pending: int, gpu: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", _BASELINE_RUN, str(tree), __file__, str(nodes), str(running), str(pending), gpu],
        capture_output=True,
        check=True,
        text=True,
    )
    times: dict[str, float] = json.loads(out.stdout)
    return times


@pytest.mark.bench
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("nodes", "running", "pending"),
    [(1_000, 4_000, 10_000), (4_000, 24_000, 116_000)],
    ids=["1k-nodes-14k-pods", "4k-nodes-140k-pods"],
)
def test_one_full_cycle(nodes: int, running: int, pending: int, tmp_path: Path) -> None:
    baseline = _baseline_tree(tmp_path)
    snapshot = synthetic(nodes, running, pending) if baseline is None else None
    for gpu in ("fgd", "binpack"):  # the default, then KAI's
        if baseline:
            before = _cycle_in_subprocess(baseline[1], nodes, running, pending, gpu)
            times = _cycle_in_subprocess(ROOT, nodes, running, pending, gpu)
        else:
            assert snapshot is not None
            before, times = None, _cycle(dataclasses.replace(snapshot, placement=Placement(gpu=gpu)))
        print(f"\n{nodes} nodes x 8 GPUs, {running} running + {pending} pending pods, 50 queues, GPUs by {gpu}:")
        print(f"  {'':44s} {'this tree':>10s}" + (f" {baseline[0][:10]:>10s}" if baseline else ""))
        for name, value in times.items():
            other = before.get(name) if before else None
            if name == "decisions" or name.startswith("pods"):
                spec = "10x" if name == "decisions" else "10d"
                print(f"  {name:44s} {int(value):{spec}}" + (f" {int(other):{spec}}" if other is not None else ""))
                continue
            unit = "" if name.endswith("/ full") else " s"
            print(f"  {name:44s} {value:10.3f}" + (f" {other:10.3f}" if other is not None else "") + unit)
        if nodes == 1_000:
            assert times["total"] < 1.0


def _api_objects(nodes: int, running: int, pending: int) -> dict[str, Any]:
    """The informers' objects for a cluster like `synthetic`'s: nodes with their agents' annotations and a slice
    of 8 GPUs each, 50 leaf queues under 5 departments, gangs of 1-16 one-GPU pods with their PodGroups and
    claims (running ones allocated and bound)."""
    from tests.unit.test_arbiter_incremental import _claim, _group, _node, _pod, _queue, _slice

    rng = random.Random(1)
    queues = [_queue("root", None, 0)]
    for d in range(5):
        queues.append(_queue(f"dept-{d}", "root", nodes * 8 / 5))
        queues += [_queue(f"team-{d}-{t}", f"dept-{d}", nodes * 8 / 50) for t in range(9)]
    leaves = [str(q["metadata"]["name"]) for q in queues if q["spec"].get("parentQueue", "root") != "root"]
    out: dict[str, Any] = {"queues": queues, "nodes": [], "slices": [], "pods": [], "claims": [], "pod_groups": []}
    for i in range(nodes):
        out["nodes"].append(_node(f"node-{i}"))
        out["slices"].append(_slice(f"node-{i}", 1, 8))
    seat = 0
    for placed, wanted in ((True, running), (False, pending)):
        made = 0
        while made < wanted:
            size = min(rng.randint(1, 16), wanted - made)
            group = f"{'r' if placed else 'p'}{len(out['pod_groups'])}"
            out["pod_groups"].append(_group(group, size, 50))
            for k in range(size):
                name = f"{group}-{k}"
                claim, pod = _claim(f"{name}-gpu", 1, False), _pod(name, f"{name}-gpu", group, rng.choice(leaves))
                if placed:
                    node = f"node-{seat // 8}"
                    claim["status"] = {
                        "allocation": {
                            "devices": {
                                "results": [
                                    {
                                        "request": "gpus",
                                        "driver": "gpu.nvidia.com",
                                        "pool": node,
                                        "device": f"gpu-{seat % 8}",
                                    }
                                ]
                            },
                            "nodeSelector": {
                                "nodeSelectorTerms": [
                                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                                ]
                            },
                        },
                        "reservedFor": [{"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}],
                    }
                    del pod["spec"]["schedulingGates"]
                    pod["spec"]["nodeName"] = node
                    seat += 1
                out["claims"].append(claim)
                out["pods"].append(pod)
            made += size
    return out


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_the_snapshot_after_one_pod_arrives() -> None:
    """The arbiter's snapshot from the informers' objects (agent.arbiter.world), 1,000 nodes and 14,000 pods: built
    from scratch, as every cycle did before issue 37, against the next one built with the last one's WorldCache after
    one pod (and its claim) arrives. CPU seconds of this thread, so a busy machine does not count."""
    from agent.arbiter.world import WorldCache, build_world
    from tests.unit.test_arbiter_incremental import _claim, _pod

    objects = _api_objects(1_000, 4_000, 10_000)

    def build(cache: WorldCache | None, weighed: dict[str, float]) -> tuple[Any, float]:
        gc.collect()
        cpu = time.thread_time()
        built = build_world(**objects, driver="gpu.nvidia.com", now=1.8e9, weighed=weighed, cache=cache)
        return built, time.thread_time() - cpu

    first, _ = build(None, {})
    full = [build(None, first.weighed)[1] for _ in range(3)]
    cache = WorldCache()
    build(cache, first.weighed)  # the cache filled, as by the cycle before
    arrived: list[float] = []
    weighed_again: list[tuple[int, int]] = []
    for i in range(3):
        name = f"arrived-{i}"
        objects["claims"] = [*objects["claims"], _claim(f"{name}-gpu", 1, False)]
        objects["pods"] = [*objects["pods"], _pod(name, f"{name}-gpu", None, "team-0-0")]
        built, seconds = build(cache, first.weighed)
        arrived.append(seconds)
        weighed_again.append((cache.pods_read, cache.jobs_weighed))
    fresh, _ = build(None, first.weighed)
    assert built.snapshot == fresh.snapshot
    print(
        f"\nthe arbiter's snapshot of 1,000 nodes and 14,000 pods ({len(fresh.snapshot.jobs)} gangs), CPU: from "
        "scratch "
        + ", ".join(f"{s:.3f}" for s in full)
        + " s; the next after one pod arrives, incremental "
        + ", ".join(f"{s:.3f}" for s in arrived)
        + f" s (pods read, gangs weighed again: {weighed_again})"
    )
