"""The arbiter's fragmentation-aware node choice (placement `fgd`): the local allocator's score, over node shapes.

A node's shape is the milli used on each of its GPUs once pending releases finish, sorted: fragmentation does
not care which GPU is which, so every node of one shape scores alike for a pod, and a find scores each shape
present once instead of each node. Fragmentation is measured against the workload in the snapshot (every
running and pending pod, the most frequent kinds covering 95 %), as FGD measures it against the trace.

The score is `packed_fgd_score` (DESIGN.md, "Placement"): FGD's drop in fragmentation at one point for a pod
that shares a GPU and at steps of two for the rest, then a node in use before an empty one. Unlike the replay,
CPU and memory are fits here, not part of the measure: a GPU cluster's scarce resource is the GPU, and leaving
CPU out is what lets nodes share a shape.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from agent.allocation.fragmentation import MILLI, NodeShape, RequestMix, fragmentation, packed_fgd_score

Shape = tuple[int, ...]  # milli used per GPU, ascending
NO_FIT = -1


def workload_mix(gpu_requests: Iterable[int]) -> RequestMix:
    """The typical request kinds of a workload, from each pod's GPU milli (whole GPUs in thousands, or a share
    of one); one whole GPU when there is no pod."""
    return mix_of(Counter(gpu_requests))


def mix_of(pods_by_milli: Mapping[int, int]) -> RequestMix:
    """`workload_mix` from pod counts already taken by GPU milli (a count of zero is no pod)."""
    counts: Counter[tuple[int, int, int, tuple[str, ...]]] = Counter()
    for milli, seen in pods_by_milli.items():
        if not seen:
            continue
        if 0 < milli < MILLI:
            kind = (0, 1, milli, ())  # a share of one GPU
        elif milli:
            kind = (0, milli // MILLI, MILLI, ())  # whole GPUs
        else:
            kind = (0, 0, 0, ())  # CPU only: every idle milli is a fragment to it
        counts[kind] += seen
    return RequestMix.of_counts(counts or {(0, 1, MILLI, ()): 1})


class ShapeScores:
    """Scores of node shapes for pod requests, memoised: a cluster has few shapes and a cycle many finds."""

    def __init__(self, mix: RequestMix) -> None:
        self.mix = mix
        self._frag: dict[Shape, int] = {}
        self._whole: dict[tuple[Shape, int], int] = {}
        self._shared: dict[tuple[Shape, int], tuple[int, int]] = {}

    def _f(self, shape: Shape) -> int:
        f = self._frag.get(shape)
        if f is None:
            free = tuple(MILLI - used for used in shape)
            f = self._frag[shape] = fragmentation(NodeShape("", 0, free), self.mix)
        return f

    def whole(self, shape: Shape, count: int) -> int:
        """The score of placing `count` whole GPUs on a node of `shape`; NO_FIT when it has too few empty."""
        key = (shape, count)
        score = self._whole.get(key)
        if score is None:
            empty = shape.count(0)
            if empty < count:
                score = NO_FIT
            else:
                after = tuple(sorted(shape[count:] + (MILLI,) * count))  # empty GPUs sort first
                score = self._score(shape, after, shares_gpu=False)
            self._whole[key] = score
        return score

    def shared(self, shape: Shape, milli: int) -> tuple[int, int]:
        """The best score for a `milli` share on a node of `shape`, and the milli used on the GPU that gets it
        (a tie goes to the fuller GPU); (NO_FIT, 0) when no GPU has room."""
        key = (shape, milli)
        best = self._shared.get(key)
        if best is None:
            best = (NO_FIT, 0)
            for used in sorted(set(shape), reverse=True):
                if used + milli <= MILLI:
                    after = list(shape)
                    after[shape.index(used)] += milli
                    score = self._score(shape, tuple(sorted(after)), shares_gpu=True)
                    if score > best[0]:
                        best = (score, used)
            self._shared[key] = best
        return best

    def _score(self, before: Shape, after: Shape, *, shares_gpu: bool) -> int:
        in_use = any(before)
        return packed_fgd_score(self._f(before) - self._f(after), self.mix.total_weight, in_use, shares_gpu)
