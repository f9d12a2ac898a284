"""Fair share, KAI's proportion division: recomputed every cycle, top-down, one resource at a time.

At each level of the queue tree the parent's share (the cluster total at the top) is divided among its
children in two phases:

1. deserved: each child gets its quota (-1 = the whole level), capped by what it can use (its demand,
   capped by its limit). Where quotas over-subscribe the level, higher-priority (then older) queues are served
   first, so shares never add up to more than there is (KAI lets them; we keep the sum bounded).
2. over quota: priority bands from highest down; inside a band, rounds divide what is left by
   overQuotaWeight among the still-hungry queues. A queue whose remaining need fits its part takes exactly
   that (and the next round re-divides the rest); the others take whole units only and remember the
   fractional remainder. Weight 0 gets nothing over quota; weight -1 outranks every weighted queue.
   What whole-unit rounding leaves over goes one unit at a time to the largest remainders (ties: higher
   band, then older queue).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.arbiter.core.model import MILLI, RESOURCES, UNLIMITED, QueueSpec, Vector

_EPS = 1e-9
UNITS = (float(MILLI), 1.0, 1.0)  # the whole unit per resource: one GPU, one millicore, one byte


@dataclass(frozen=True, slots=True)
class Claim:
    """One child's terms at one level for one resource."""

    quota: float
    limit: float
    weight: float
    priority: int
    request: float
    order: int  # smaller = older queue; the final tie-break

    @property
    def requestable(self) -> float:
        return self.request if self.limit == UNLIMITED else min(self.limit, self.request)


def divide(amount: float, claims: Sequence[Claim], unit: float = 1.0) -> list[float]:
    """Split `amount` among `claims`; returns each claim's share, in order."""
    n = len(claims)
    cap = [c.requestable for c in claims]
    share = [0.0] * n
    remaining = amount
    for i in sorted(range(n), key=lambda i: (-claims[i].priority, claims[i].order)):
        quota = amount if claims[i].quota == UNLIMITED else claims[i].quota
        share[i] = max(0.0, min(quota, cap[i], remaining))
        remaining -= share[i]

    remainder = [0.0] * n
    for band in sorted({c.priority for c in claims}, reverse=True):
        members = [i for i in range(n) if claims[i].priority == band]
        while remaining > _EPS:
            hungry = [i for i in members if cap[i] - share[i] > _EPS and claims[i].weight != 0]
            if not hungry:
                break
            unlimited = [i for i in hungry if claims[i].weight == UNLIMITED]
            weights = {i: 1.0 for i in unlimited} if unlimited else {i: claims[i].weight for i in hungry}
            total_weight = sum(weights.values())
            pool, given, satisfied = remaining, 0.0, False
            for i, weight in weights.items():
                offer = pool * weight / total_weight
                need = cap[i] - share[i]
                if need <= offer + _EPS:
                    take, satisfied = need, True
                    remainder[i] = 0.0
                else:
                    take = math.floor(offer / unit + _EPS) * unit
                    remainder[i] = offer - take
                share[i] += take
                given += take
            remaining -= given
            if not satisfied:
                break

    leftovers = sorted(
        (i for i in range(n) if remainder[i] > _EPS and cap[i] - share[i] > _EPS),
        key=lambda i: (-claims[i].priority, -remainder[i], claims[i].order),
    )
    for i in leftovers:
        if remaining <= _EPS:
            break
        take = min(unit, remaining, cap[i] - share[i])
        share[i] += take
        remaining -= take
    return share


def fair_shares(
    queues: Sequence[QueueSpec], demand: Mapping[str, Vector], total: Vector
) -> dict[str, Vector]:
    """Fair share of every queue, parents included. `demand` is allocated + pending per leaf queue."""
    order = {q.name: i for i, q in enumerate(queues)}
    children: dict[str | None, list[QueueSpec]] = {}
    for q in queues:
        children.setdefault(q.parent, []).append(q)

    rolled: dict[str, list[float]] = {}

    def roll_up(q: QueueSpec) -> list[float]:
        own = list(demand.get(q.name, (0.0, 0.0, 0.0)))
        for child in children.get(q.name, []):
            own = [a + b for a, b in zip(own, roll_up(child), strict=True)]
        rolled[q.name] = own
        return own

    for top in children.get(None, []):
        roll_up(top)

    shares: dict[str, list[float]] = {q.name: [0.0, 0.0, 0.0] for q in queues}

    def split(parent: str | None, amounts: Sequence[float]) -> None:
        kids = children.get(parent, [])
        if not kids:
            return
        for r in range(len(RESOURCES)):
            claims = [
                Claim(
                    quota=k.terms[r].quota,
                    limit=k.terms[r].limit,
                    weight=k.terms[r].over_quota_weight,
                    priority=k.priority,
                    request=rolled[k.name][r],
                    order=order[k.name],
                )
                for k in kids
            ]
            for k, s in zip(kids, divide(amounts[r], claims, UNITS[r]), strict=True):
                shares[k.name][r] = s
        for k in kids:
            split(k.name, shares[k.name])

    split(None, total)
    return {name: (s[0], s[1], s[2]) for name, s in shares.items()}
