"""Fair share, KAI's proportion division: recomputed every cycle, top-down, one resource at a time.

At each level of the queue tree the parent's share (the cluster total at the top) is divided among its
children in two phases:

1. deserved: each child gets its quota (-1 = the whole level), capped by what it can use (its demand,
   capped by its limit). Quotas that over-subscribe the level are not scaled down (KAI,
   resource_division.go setDeservedResource): each child still deserves min(quota, requestable), the shares
   then add up to more than the level, and nothing is left for the over-quota phase.
2. over quota: priority bands from highest down; inside a band, rounds divide what is left by
   overQuotaWeight among the still-hungry queues. A queue whose remaining need fits its part takes exactly
   that (and the next round re-divides the rest); the others take whole units only and remember the
   fractional remainder. Weight 0 gets nothing over quota; weight -1 outranks every weighted queue.
   What whole-unit rounding leaves over goes one unit at a time to the largest remainders (ties: higher
   band, then older queue).

Time-aware fairness (KAI v0.10's time-based fair share): a queue's `usage` (its share of the cluster's
capacity used over a past window, decayed, 0..1) shifts only the over-quota division: each hungry queue's
normalised weight w becomes max(0, w + k (w - usage)) (resource_division.go calcShareWeights). With no usage
history every usage is 0 and the weights divide as plain overQuotaWeight. The in-quota part never moves.
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
    usage: float = 0.0  # time-aware fair share: the queue's normalised past usage of this resource (0..1)

    @property
    def requestable(self) -> float:
        return self.request if self.limit == UNLIMITED else min(self.limit, self.request)


def divide(amount: float, claims: Sequence[Claim], unit: float = 1.0, k_value: float = 1.0) -> list[float]:
    """Split `amount` among `claims`; returns each claim's share, in order. `k_value` weighs past usage
    against the configured weights (KAI's kValue); it matters only where some claim has usage."""
    n = len(claims)
    cap = [c.requestable for c in claims]
    share = [0.0] * n
    remaining = amount
    for i in range(n):
        quota = amount if claims[i].quota == UNLIMITED else claims[i].quota
        share[i] = max(0.0, min(quota, cap[i]))
        remaining -= share[i]
    if remaining <= _EPS:
        return share

    remainder = [0.0] * n
    for band in sorted({c.priority for c in claims}, reverse=True):
        members = [i for i in range(n) if claims[i].priority == band]
        while remaining > _EPS:
            hungry = [i for i in members if cap[i] - share[i] > _EPS and claims[i].weight != 0]
            if not hungry:
                break
            unlimited = [i for i in hungry if claims[i].weight == UNLIMITED]
            weights = {i: 1.0 for i in unlimited} if unlimited else {i: claims[i].weight for i in hungry}
            weights = _usage_adjusted(weights, claims, k_value)
            total_weight = sum(weights.values())
            if total_weight <= 0:
                break
            pool, given, satisfied = remaining, 0.0, False
            for i, weight in weights.items():
                # the weight's fraction first: pool * weight can round (a denormal weight) and offer more than pool
                offer = pool * (weight / total_weight)
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


def _usage_adjusted(weights: dict[int, float], claims: Sequence[Claim], k_value: float) -> dict[int, float]:
    """KAI's share weight: the normalised weight, pulled down by usage above it and up by usage below it."""
    if not any(claims[i].usage for i in weights):
        return weights
    total = sum(weights.values())
    if total <= 0:
        return weights
    adjusted = {}
    for i, weight in weights.items():
        normal = weight / total
        adjusted[i] = max(0.0, normal + k_value * (normal - claims[i].usage))
    return adjusted


def fair_shares(
    queues: Sequence[QueueSpec],
    demand: Mapping[str, Vector],
    total: Vector,
    usage: Mapping[str, Vector] | None = None,
    k_value: float = 1.0,
) -> dict[str, Vector]:
    """Fair share of every queue, parents included. `demand` is allocated + pending per leaf queue; `usage`
    (time-aware fair share) the normalised past usage per queue, parents included, 0..1 per resource."""
    usage = usage or {}
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
                    usage=usage.get(k.name, (0.0, 0.0, 0.0))[r],
                )
                for k in kids
            ]
            for k, s in zip(kids, divide(amounts[r], claims, UNITS[r], k_value), strict=True):
                shares[k.name][r] = s
        for k in kids:
            split(k.name, shares[k.name])

    split(None, total)
    return {name: (s[0], s[1], s[2]) for name, s in shares.items()}
