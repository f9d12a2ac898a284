"""GPU fragmentation of one node for an expected mix of requests (the FGD measure, Weng et al., ATC'23).

A node's idle GPU capacity is a fragment for a request it cannot serve: for a request that fits, the idle
part of the GPUs too small for it; for one that does not fit at all (model, CPU, too few GPUs), every idle
milli. Weighted by how often each request kind occurs, that gives F. Placing work where F grows least keeps
capacity usable. F is kept as an exact integer (counts times milli) so "no change" compares exactly.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

MILLI = 1000  # one whole GPU


@dataclass(frozen=True)
class RequestKind:
    """One kind of request in the expected mix: CPU, GPUs and GPU milli each, allowed models (empty: any)."""

    cpu_milli: int
    gpu_count: int
    gpu_milli: int  # per GPU; 1000 for whole GPUs
    models: tuple[str, ...] = ()
    weight: int = 1  # how many requests of this kind were seen

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True)
class NodeShape:
    """What fragmentation looks at: the model, free CPU and the idle milli of each GPU."""

    model: str
    cpu_free: int
    gpu_free: tuple[int, ...]


@dataclass(frozen=True)
class RequestMix:
    """The expected request mix: the most frequent kinds covering a share of all requests."""

    kinds: tuple[RequestKind, ...]

    @cached_property
    def total_weight(self) -> int:  # read on every score: summed once
        return sum(k.weight for k in self.kinds)

    @classmethod
    def typical(cls, requests: Iterable[RequestKind], coverage: float = 0.95) -> RequestMix:
        """Most frequent kinds (CPU-only ones included) until their count reaches `coverage` of all."""
        return cls.of_counts(Counter((r.cpu_milli, r.gpu_count, r.gpu_milli, r.models) for r in requests), coverage)

    @classmethod
    def of_counts(
        cls, counts: Mapping[tuple[int, int, int, tuple[str, ...]], int], coverage: float = 0.95
    ) -> RequestMix:
        """`typical` from counts already taken: (CPU milli, GPU count, GPU milli, models) -> requests seen."""
        if not 0 < coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        total = sum(counts.values())
        if total == 0:
            raise ValueError("a request mix needs at least one request")
        chosen: list[RequestKind] = []
        covered = 0
        # most frequent first; equal counts in a stable order so the mix is reproducible
        for (cpu, n, milli, models), count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if covered >= coverage * total:
                break
            chosen.append(RequestKind(cpu, n, milli, models, count))
            covered += count
        return cls(tuple(chosen))


def fragment_of(node: NodeShape, kind: RequestKind) -> int:
    """Idle milli on `node` that `kind` cannot use."""
    idle = sum(node.gpu_free)
    if kind.gpu_count == 0 or not kind.allows(node.model) or node.cpu_free < kind.cpu_milli:
        return idle
    usable = sum(1 for free in node.gpu_free if free >= kind.gpu_milli)
    if usable < kind.gpu_count:
        return idle
    return sum(free for free in node.gpu_free if free < kind.gpu_milli)


def fragmentation(node: NodeShape, mix: RequestMix) -> int:
    """F times the mix's total weight: an exact integer (divide by total_weight for milli).

    Same as summing weight * fragment_of over the kinds, with the per-threshold sums computed once.
    """
    idle = sum(node.gpu_free)
    by_threshold: dict[int, tuple[int, int]] = {}  # milli -> (GPUs with that much free, idle on the rest)
    total = 0
    for k in mix.kinds:
        x = idle
        if k.gpu_count and node.cpu_free >= k.cpu_milli and k.allows(node.model):
            split = by_threshold.get(k.gpu_milli)
            if split is None:
                t = k.gpu_milli
                split = by_threshold[t] = (
                    sum(1 for f in node.gpu_free if f >= t),
                    sum(f for f in node.gpu_free if f < t),
                )
            if split[0] >= k.gpu_count:
                x = split[1]
        total += k.weight * x
    return total


def after_placing(node: NodeShape, cpu_milli: int, gpu_milli: int, gpus: Sequence[int]) -> NodeShape:
    """The node once a request took `cpu_milli` and `gpu_milli` on each GPU index in `gpus`."""
    free = list(node.gpu_free)
    for i in gpus:
        free[i] -= gpu_milli
    return NodeShape(node.model, node.cpu_free - cpu_milli, tuple(free))


def fgd_score(drop: int, total_weight: int) -> int:
    """FGD's 0-100 node score from the drop of F (times the mix weight): 50 when F is unchanged."""
    return int(100 / (1 + math.exp(-drop / total_weight / MILLI)))


def packed_fgd_score(drop: int, total_weight: int, in_use: bool, shares_gpu: bool = False) -> int:
    """Our placement score: FGD's score, coarsened to steps of two points unless the pod shares a GPU, then a
    node already in use before an empty one (the caller then applies a stable node order).

    Why the two resolutions (measured on the openb pod lists; DESIGN.md has the numbers): for a
    whole-GPU or CPU-only pod, nodes whose fragmentation outcomes differ by under two points (~0.08 GPU) are
    as good as equal, and letting them tie sends the pod to a node in use, which keeps empty nodes whole for
    multi-GPU and model-constrained pods. For a pod that shares a GPU those small differences are the
    information: which partly used GPU its size fills, so it keeps FGD's own one-point resolution.
    """
    step = 1 if shares_gpu else 2
    return (fgd_score(drop, total_weight) // step) * step * 2 + int(in_use)
