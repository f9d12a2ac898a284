"""Time-aware fair share in a running arbiter: each queue's decayed past usage, kept in the Queue's status so
a restarted (or newly elected) arbiter carries on where the last one stopped. Pure.

`status.usage` is the normalised usage people read (0..1 of the cluster, per resource); `status.usageState` the
running sums behind it (allocation and capacity times decayed seconds, in the snapshot's units), written at
most every `PERSIST_EVERY_S` so a cycle a second does not mean a write a second.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.arbiter.core.model import MILLI, Snapshot, Vector
from agent.arbiter.core.usage import Accumulator
from agent.times import parse_rfc3339, rfc3339

PERSIST_EVERY_S = 60.0
_KEYS = ("gpu", "cpu", "memory")
_ZERO: Vector = (0.0, 0.0, 0.0)


def held(snapshot: Snapshot) -> dict[str, Vector]:
    """What each queue (its ancestors included) holds now: its running pods' requests."""
    parents = {q.name: q.parent for q in snapshot.queues}
    out: dict[str, list[float]] = {}
    for job in snapshot.jobs:
        for pod in job.pods:
            if pod.status != "Running":
                continue
            name: str | None = job.queue
            while name is not None:
                total = out.setdefault(name, [0.0, 0.0, 0.0])
                for r, v in enumerate(pod.request):
                    total[r] += v
                name = parents.get(name)
    return {name: (v[0], v[1], v[2]) for name, v in out.items()}


def capacity(snapshot: Snapshot) -> Vector:
    nodes = snapshot.nodes
    return (
        float(sum(n.gpus for n in nodes) * MILLI),
        float(sum(n.cpu_milli for n in nodes)),
        float(sum(n.mem_bytes for n in nodes)),
    )


def _vector(raw: object) -> Vector | None:
    if not isinstance(raw, Mapping):
        return None
    try:
        values = [float(raw.get(k, 0.0)) for k in _KEYS]
    except (TypeError, ValueError):
        return None
    return (values[0], values[1], values[2])


def from_status(status: Mapping[str, Any] | None) -> Accumulator:
    """The running sums a Queue's status carries; empty (a fresh start) when absent or unreadable."""
    state = (status or {}).get("usageState")
    if not isinstance(state, Mapping):
        return Accumulator()
    used, possible = _vector(state.get("used")), _vector(state.get("possible"))
    at = parse_rfc3339(state.get("updatedAt"))
    if at is None or used is None or possible is None:
        return Accumulator()
    return Accumulator(used, possible, at)


def to_status(acc: Accumulator) -> dict[str, Any]:
    return {
        "used": dict(zip(_KEYS, acc.used, strict=True)),
        "possible": dict(zip(_KEYS, acc.possible, strict=True)),
        "updatedAt": rfc3339(acc.at or 0.0),
    }


def shown(acc: Accumulator) -> dict[str, float]:
    return {k: round(v, 4) for k, v in zip(_KEYS, acc.usage, strict=True)}
