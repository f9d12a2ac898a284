"""Queue `status` as the arbiter writes it each cycle: pure. Units as in the Queue's spec (KAI's): GPUs in
devices, CPU in millicores, memory in MB; parents include their children."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.arbiter.core.cycle import CycleResult
from agent.arbiter.core.model import MILLI, Snapshot, Vector

_MB = 1_000_000


def _units(v: Vector) -> dict[str, float]:
    return {"gpu": round(v[0] / MILLI, 3), "cpu": round(v[1], 3), "memory": round(v[2] / _MB, 3)}


def _children(snapshot: Snapshot) -> dict[str, list[str]]:
    """Parent queue -> its child queues, in the snapshot's order."""
    children: dict[str, list[str]] = {}
    for q in snapshot.queues:
        if q.parent is not None:
            children.setdefault(q.parent, []).append(q.name)
    return children


def queue_statuses(snapshot: Snapshot, result: CycleResult) -> dict[str, dict[str, Any]]:
    parent = {q.name: q.parent for q in snapshot.queues}
    requested: dict[str, list[float]] = {q.name: [0.0, 0.0, 0.0] for q in snapshot.queues}
    non_preemptible: dict[str, list[float]] = {q.name: [0.0, 0.0, 0.0] for q in snapshot.queues}
    for job in snapshot.jobs:
        for pod in job.pods:
            if pod.status == "Releasing":
                continue
            holds = result.pods[pod.name].outcome == "running"
            name: str | None = job.queue
            seen: set[str] = set()
            while name is not None and name in requested and name not in seen:
                seen.add(name)
                for r, v in enumerate(pod.request):
                    requested[name][r] += v
                    if holds and not job.preemptible:
                        non_preemptible[name][r] += v
                name = parent.get(name)
    children = _children(snapshot)
    out: dict[str, dict[str, Any]] = {}
    for q in snapshot.queues:
        req, np_ = requested[q.name], non_preemptible[q.name]
        out[q.name] = {
            "childQueues": sorted(children.get(q.name, [])),
            "allocated": _units(result.allocated.get(q.name, (0.0, 0.0, 0.0))),
            "allocatedNonPreemptible": _units((np_[0], np_[1], np_[2])),
            "requested": _units((req[0], req[1], req[2])),
            "fairShare": _units(result.fair_share.get(q.name, (0.0, 0.0, 0.0))),
        }
    return out


STRANDED = "PodsStranded"  # the condition on a parent queue that pending pods name, and on its children


def stranded_reasons(snapshot: Snapshot, stranded: Mapping[str, int]) -> dict[str, tuple[str, str]]:
    """Queue -> (reason, message) of its `PodsStranded` condition. Only leaf queues take pods (KAI skips jobs
    whose queue has children), so a child Queue created under a leaf strands that leaf's pending pods: both the
    former leaf (`stranded`: parent queue -> pending pods naming it) and the child that made it a parent say so."""
    children = _children(snapshot)
    out: dict[str, tuple[str, str]] = {}
    for parent, count in sorted(stranded.items()):
        below = sorted(children.get(parent, []))
        pods = f"{count} pending pod(s) name queue {parent}"
        until = (
            f"they wait until they name a leaf queue, or {parent} has no child queue again (pods may only be "
            "submitted to leaf queues)"
        )
        out[parent] = (
            "ParentQueueHasPods",
            f"{pods}, a parent queue since {', '.join(below)} named it as parentQueue; {until}",
        )
        for child in below:
            out[child] = ("MadeParentOfPods", f"this queue made {parent} a parent queue, and {pods}; {until}")
    return out
