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
from pathlib import Path

import pytest

from agent.arbiter.core.cycle import ACTIONS, gc_paused, run_cycle
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
        NodeSpec(f"node-{i}", 8, 128_000, 1024 * GIB, "H100", {"pool": "a" if i % 2 else "b"},
                 ((0, 1, 2, 3), (4, 5, 6, 7)))
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
        start = time.perf_counter()
        session = Session(snapshot)
        times["session (snapshot + fair share)"] = time.perf_counter() - start
        for name in ("allocate", "consolidate", "reclaim", "preempt"):
            t = time.perf_counter()
            ACTIONS[name](session)
            times[name] = time.perf_counter() - t
        times["total"] = time.perf_counter() - start
    bound = sum(1 for p in session.pods if p.state in ("bound", "pipelined"))
    evicted = sum(1 for p in session.pods if p.state == "evicted")
    del session
    t = time.perf_counter()
    gc.collect()
    times["collection after the cycle"] = time.perf_counter() - t
    t = time.perf_counter()
    result = run_cycle(snapshot)  # as `simulate` times it: with the decisions and the next round's snapshot
    times["run_cycle (simulate's cycleSeconds)"] = time.perf_counter() - t
    times["pods placed"] = bound
    times["pods evicted"] = evicted
    times["decisions"] = int(hashlib.sha256(repr(sorted(result.pods.items())).encode()).hexdigest()[:8], 16)
    return times


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
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, "agent"],
                             capture_output=True, check=False)
    if archive.returncode != 0:
        print(f"\nno baseline: git archive {ref}: {archive.stderr.decode().strip()}")
        return None
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tmp, filter="data")
    return ref, tmp


def _cycle_in_subprocess(tree: Path, nodes: int, running: int, pending: int, gpu: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _BASELINE_RUN, str(tree), __file__, str(nodes), str(running),
                          str(pending), gpu], capture_output=True, check=True, text=True)
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
        print(f"  {'':38s} {'this tree':>10s}" + (f" {baseline[0][:10]:>10s}" if baseline else ""))
        for name, value in times.items():
            other = before.get(name) if before else None
            if name == "decisions" or name.startswith("pods"):
                spec = "10x" if name == "decisions" else "10d"
                print(f"  {name:38s} {int(value):{spec}}" + (f" {int(other):{spec}}" if other is not None else ""))
                continue
            print(f"  {name:38s} {value:10.3f}" + (f" {other:10.3f}" if other is not None else "") + " s")
        if nodes == 1_000:
            assert times["total"] < 1.0
