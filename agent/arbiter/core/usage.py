"""Time-aware fair share: each queue's past usage, decayed and normalised to what the cluster could give.

KAI v0.10's time-based fair share reads a queue's allocation history from Prometheus; here the history is
plain data (samples of what a queue held from `start` to `end`), so it can be kept in the API and tested.
Usage over the window [now - window, now] weighs each moment by 0.5^(age / half-life) (all moments alike
without a half-life) and is divided by the cluster's capacity over the same window with the same weights: a
queue that held the whole cluster the whole window has usage 1. Parents count their children's usage.

`Accumulator` is the same quantity kept as a running sum (decayed, no window), so a controller can persist
two numbers per queue and resource and fold each interval in as it passes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent.arbiter.core.model import QueueSpec, Vector

_ZERO: Vector = (0.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class UsageSample:
    queue: str
    start: float  # seconds since the epoch
    end: float
    allocated: Vector  # what the queue held throughout (GPUs in milli-GPUs, CPU millicores, memory bytes)


def weight(start: float, end: float, now: float, half_life: float | None) -> float:
    """The decayed length of [start, end] seen from `now`: the integral of 0.5^((now - t) / half_life)."""
    if end <= start:
        return 0.0
    if half_life is None:
        return end - start
    rate = math.log(2) / half_life
    return (math.exp(-rate * (now - end)) - math.exp(-rate * (now - start))) / rate


def queue_usage(
    samples: Iterable[UsageSample],
    queues: Sequence[QueueSpec],
    capacity: Vector,
    *,
    now: float,
    window: float,
    half_life: float | None = None,
) -> dict[str, Vector]:
    """Normalised usage (0..1 per resource) of every queue with history, its ancestors included."""
    possible = weight(now - window, now, now, half_life)
    if possible <= 0:
        return {}
    parents = {q.name: q.parent for q in queues}
    used: dict[str, list[float]] = {}
    for s in samples:
        w = weight(max(s.start, now - window), min(s.end, now), now, half_life)
        if w <= 0:
            continue
        name: str | None = s.queue
        while name is not None:
            total = used.setdefault(name, [0.0, 0.0, 0.0])
            for r in range(3):
                total[r] += s.allocated[r] * w
            name = parents.get(name)
    return {
        name: (
            _ratio(u[0], capacity[0] * possible),
            _ratio(u[1], capacity[1] * possible),
            _ratio(u[2], capacity[2] * possible),
        )
        for name, u in used.items()
    }


def _ratio(used: float, possible: float) -> float:
    return used / possible if possible > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Accumulator:
    """Decayed usage as a running sum: `used` (allocation x decayed seconds) over `possible` (capacity x
    decayed seconds), as of `at`."""

    used: Vector = _ZERO
    possible: Vector = _ZERO
    at: float | None = None

    def advance(self, now: float, allocated: Vector, capacity: Vector, half_life: float | None) -> Accumulator:
        """Fold in [at, now] during which the queue held `allocated` of `capacity`."""
        if self.at is None or now <= self.at:
            return Accumulator(self.used, self.possible, now if self.at is None else self.at)
        decay = 1.0 if half_life is None else 0.5 ** ((now - self.at) / half_life)
        w = weight(self.at, now, now, half_life)
        used = tuple(u * decay + a * w for u, a in zip(self.used, allocated, strict=True))
        possible = tuple(p * decay + c * w for p, c in zip(self.possible, capacity, strict=True))
        return Accumulator((used[0], used[1], used[2]), (possible[0], possible[1], possible[2]), now)

    @property
    def usage(self) -> Vector:
        return (
            _ratio(self.used[0], self.possible[0]),
            _ratio(self.used[1], self.possible[1]),
            _ratio(self.used[2], self.possible[2]),
        )
