"""The arbiter's shape scores (placement fgd) are the local allocator's score of each node, computed per shape."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.allocation.fragmentation import NodeShape, after_placing, fragmentation, packed_fgd_score
from agent.arbiter.core.fragments import MILLI, NO_FIT, ShapeScores, workload_mix

USED = st.lists(st.sampled_from([0, 0, 0, 250, 300, 500, 700, 1000]), min_size=1, max_size=8)
WORKLOAD = st.lists(st.sampled_from([0, 250, 500, 1000, 2000, 4000, 8000]), min_size=1, max_size=30)


def direct(used: list[int], workload: list[int], count: int, milli: int, gpus: list[int]) -> int:
    """The score of one node for one placement, the way the allocator computes it: no shapes, no memo."""
    mix = workload_mix(workload)
    node = NodeShape("", 0, tuple(MILLI - u for u in used))
    drop = fragmentation(node, mix) - fragmentation(after_placing(node, 0, milli, gpus), mix)
    return packed_fgd_score(drop, mix.total_weight, any(used), shares_gpu=milli < MILLI)


@settings(max_examples=200, deadline=None)
@given(USED, WORKLOAD, st.integers(1, 4))
def test_whole_gpus_score_as_the_node_scores_whatever_gpu_is_which(
    used: list[int], workload: list[int], count: int
) -> None:
    scores = ShapeScores(workload_mix(workload))
    got = scores.whole(tuple(sorted(used)), count)
    empty = [g for g, u in enumerate(used) if u == 0]
    if len(empty) < count:
        assert got == NO_FIT
    else:
        assert got == direct(used, workload, count, MILLI, empty[:count])


@settings(max_examples=200, deadline=None)
@given(USED, WORKLOAD, st.sampled_from([100, 250, 500, 700]))
def test_a_share_scores_the_best_gpu_of_the_node(used: list[int], workload: list[int], milli: int) -> None:
    scores = ShapeScores(workload_mix(workload))
    got, on = scores.shared(tuple(sorted(used)), milli)
    options = [(direct(used, workload, 1, milli, [g]), u) for g, u in enumerate(used) if u + milli <= MILLI]
    if not options:
        assert got == NO_FIT
    else:
        best = max(s for s, _ in options)
        assert got == best
        assert on == max(u for s, u in options if s == best)  # ties go to the fuller GPU


def test_the_workload_mix_counts_whole_gpus_and_shares_apart() -> None:
    mix = workload_mix([1000, 1000, 4000, 500, 0])
    kinds = {(k.gpu_count, k.gpu_milli): k.weight for k in mix.kinds}
    assert kinds == {(1, 1000): 2, (4, 1000): 1, (1, 500): 1, (0, 0): 1}
    assert workload_mix([]).kinds[0].gpu_count == 1  # nothing to learn from: one whole GPU
