"""Queue `status` as the arbiter writes it each cycle: pure. Units as in the Queue's spec (KAI's): GPUs in
devices, CPU in millicores, memory in MB; parents include their children."""

from __future__ import annotations

from typing import Any

from agent.arbiter.core.cycle import CycleResult
from agent.arbiter.core.model import MILLI, Snapshot, Vector

_MB = 1_000_000


def _units(v: Vector) -> dict[str, float]:
    return {"gpu": round(v[0] / MILLI, 3), "cpu": round(v[1], 3), "memory": round(v[2] / _MB, 3)}


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
    children: dict[str, list[str]] = {}
    for q in snapshot.queues:
        if q.parent is not None:
            children.setdefault(q.parent, []).append(q.name)
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
