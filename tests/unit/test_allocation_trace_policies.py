"""The FGD paper's policy scores and fragmentation on hand-computed examples (openb-protocol.md, section 5)."""

from __future__ import annotations

import csv
import pathlib
import random

import pytest

from agent.allocation.fragmentation import (
    NodeShape,
    RequestKind,
    RequestMix,
    fgd_score,
    fragment_of,
    fragmentation,
    packed_fgd_score,
)
from agent.simulation.replay import TraceNode, build_workload, parse_pods, replay_once, typical_mix
from agent.simulation.trace_policies import (
    BestFitPolicy,
    ClusteringPolicy,
    DotProdPolicy,
    FgdPolicy,
    NearPolicy,
    NodeView,
    OursPolicy,
    PackingPolicy,
    TracePod,
    fits,
    tightest_gpus,
)


def node(
    gpu_free: tuple[int, ...],
    cpu: int = 64000,
    mem: int = 262144,
    tags: frozenset[str] = frozenset(),
    model: str = "T4",
) -> NodeView:
    return NodeView(model, cpu, mem, gpu_free, tags)


def pod(gpus: int = 1, milli: int = 1000, cpu: int = 8000, mem: int = 1024, models: tuple[str, ...] = ()) -> TracePod:
    return TracePod("p", cpu, mem, gpus, milli if gpus else 0, models)


def test_dotprod_and_bestfit_scores() -> None:
    n, p = node((1000, 1000)), pod(milli=500)
    # dot = 64000*8000/128000^2 + 2000*500/8000^2 = 0.03125 + 0.015625; int(100*(1 - dot/2)) = 97
    assert DotProdPolicy().score(n, p) == 97
    # left = 56000/128000 + 1500/8000 = 0.625; int(100*(1 - 0.3125)) = 68
    assert BestFitPolicy().score(n, p) == 68


def test_clustering_scores_by_tags_and_fullness() -> None:
    c = ClusteringPolicy()
    half = (1000, 1000, 1000, 1000, 500, 500, 0, 0)  # 5000 idle: 25*3000//8000 = 9
    share = pod(milli=300)
    assert c.score(node(half, tags=frozenset({"share-gpu"})), share) == 9 + 75
    assert c.score(node(half, tags=frozenset({"share-gpu", "1-gpu"})), share) == 9 + 50
    assert c.score(node((1000,) * 8), share) == 0 + 25
    assert c.score(node(half, tags=frozenset({"8-gpu"})), share) == 9
    assert c.score(node(half), pod(gpus=0)) == 0


def test_packing_scores_cases() -> None:
    p = PackingPolicy()
    assert p.score(node((1000,) * 8), pod()) == 25  # all free: max(33-8, 8)
    assert p.score(node((1000,) * 2), pod()) == 31  # a smaller empty node is preferred
    assert p.score(node((1000, 200)), pod()) == 49  # has to open one free GPU: max(50-1, 33)
    assert p.score(node((1000, 1000, 1000, 0)), pod(gpus=2)) == 48
    assert p.score(node((1000, 400)), pod(milli=300)) == 96  # shared on a used GPU: 100 - 400//100
    assert p.score(node((1000, 400)), pod(gpus=0)) == 0


def test_fragment_of_each_case() -> None:
    shape = NodeShape("T4", 4000, (1000, 300, 0))
    assert fragment_of(shape, RequestKind(0, 1, 500)) == 300  # fits: GPUs too small for it count
    assert fragment_of(shape, RequestKind(0, 2, 1000)) == 1300  # needs two free GPUs: all idle
    assert fragment_of(shape, RequestKind(8000, 1, 500)) == 1300  # not enough CPU: all idle
    assert fragment_of(shape, RequestKind(0, 1, 500, ("V100M32",))) == 1300  # wrong model: all idle
    assert fragment_of(shape, RequestKind(0, 0, 0)) == 1300  # CPU-only kinds count all idle
    mix = RequestMix((RequestKind(0, 1, 500, (), 3), RequestKind(0, 2, 1000, (), 1)))
    assert fragmentation(shape, mix) == 3 * 300 + 1300


def test_fgd_score_and_gpu_choice() -> None:
    mix = RequestMix((RequestKind(0, 1, 500, (), 1), RequestKind(0, 1, 1000, (), 1)))
    fgd = FgdPolicy(mix)
    n = node((1000, 300))
    # F before = 300 + 300. 250 milli on GPU1: F = 50 + 50, drop 500/2 weight = 250 milli: int(100*sigmoid(0.25)) = 56
    # on GPU0: F = 300 + 1050, drop -375 milli: 40. FGD takes GPU1.
    assert fgd.score(n, pod(milli=250, cpu=0)) == 56
    assert fgd.choose_gpus(n, pod(milli=250, cpu=0), random.Random(0)) == (1,)
    assert fgd.score(n, pod(gpus=0, cpu=0)) == 50  # F unchanged scores exactly 50


def test_ours_ranks_by_fgd_then_prefers_used_nodes() -> None:
    mix = RequestMix((RequestKind(0, 1, 1000, (), 1),))
    ours, fgd = OursPolicy(mix), FgdPolicy(mix)
    empty, used = node((1000, 1000, 1000)), node((1000, 1000, 0), tags=frozenset({"1-gpu"}))
    p = pod(cpu=0)
    assert fgd.score(empty, p) == fgd.score(used, p)  # FGD cannot tell them apart
    assert ours.score(used, p) > ours.score(empty, p)


def test_filter_and_default_gpu_choice() -> None:
    n = node((1000, 600, 300, 1000))
    assert tightest_gpus(n, pod(milli=250)) == (2,)
    assert tightest_gpus(n, pod(gpus=2)) == (0, 3)
    assert fits(n, pod(gpus=2)) and not fits(n, pod(gpus=3))
    assert not fits(n, pod(models=("V100M16", "V100M32")))  # tried: a model the node does not have
    assert not fits(n, pod(cpu=65000)) and not fits(n, pod(mem=300000))


def test_typical_mix_covers_the_requested_share() -> None:
    reqs = [RequestKind(1, 1, 500)] * 6 + [RequestKind(2, 1, 1000)] * 3 + [RequestKind(3, 0, 0)]
    mix = RequestMix.typical(reqs, 0.9)
    assert [(k.cpu_milli, k.weight) for k in mix.kinds] == [(1, 6), (2, 3)]
    with pytest.raises(ValueError, match="coverage"):  # tried: a coverage above 100%
        RequestMix.typical(reqs, 1.5)


def test_typical_mix_of_the_default_trace(shared_dir: pathlib.Path) -> None:
    with (shared_dir / "data/traces/openb_pod_list_default.csv").open() as f:
        mix = typical_mix(parse_pods(csv.DictReader(f)))
    assert (len(mix.kinds), mix.total_weight) == (35, 7766)  # the protocol's count


def test_workload_scales_to_130_percent_with_originals_first() -> None:
    pods = [TracePod(f"p{i}", 1000, 1, 1, 500) for i in range(10)]
    load = build_workload(pods, capacity_milli=10_000, rng=random.Random(1))
    assert sorted(p.name for p in load[:10]) == sorted(p.name for p in pods)
    assert sum(p.total_gpu_milli for p in load) == 13_000
    many = [TracePod(f"p{i}", 1000, 1, 1, 1000) for i in range(30)]
    assert sum(p.total_gpu_milli for p in build_workload(many, 10_000, random.Random(1))) <= 13_000


def test_unallocated_share_at_full_arrival() -> None:
    nodes = [TraceNode("n0", 64000, 1024, 2, "T4")]
    pods = [TracePod("a", 1000, 1, 1, 1000)]  # two copies reach 100%: both placed
    assert replay_once(nodes, pods, PackingPolicy(), 42).unallocated_percent == 0
    hungry = [TracePod("b", 128000, 1, 1, 1000)]  # never fits: everything stays unallocated
    assert replay_once(nodes, hungry, PackingPolicy(), 42).unallocated_percent == 100
    with pytest.raises(ValueError, match="tie regime"):  # tried: an unknown tie regime
        replay_once(nodes, pods, PackingPolicy(), 42, ties="sometimes")


def test_ours_keeps_fgds_resolution_for_shared_pods_and_coarsens_the_rest() -> None:
    """Two outcomes one FGD point apart (49 and 48): a pod sharing a GPU tells them apart, a whole-GPU pod
    lets them tie, and then a node in use wins; being in use never outweighs a better shared outcome."""
    better, worse = -30, -70  # drops of F (weight 1), in milli-GPU
    assert (fgd_score(better, 1), fgd_score(worse, 1)) == (49, 48)
    assert packed_fgd_score(better, 1, in_use=False, shares_gpu=True) > packed_fgd_score(
        worse, 1, in_use=True, shares_gpu=True
    )
    assert packed_fgd_score(better, 1, in_use=False) < packed_fgd_score(worse, 1, in_use=True)
    assert packed_fgd_score(better, 1, in_use=False) == packed_fgd_score(worse, 1, in_use=False)


def test_near_scores_the_exact_saved_fragment_and_still_places_pods_that_grow_it() -> None:
    """`near` (the alternative DESIGN.md compares): micro-GPU of expected fragment saved, negative when the
    placement leaves GPUs the workload cannot use; such pods are still placed, and a used node goes first
    among outcomes within the window."""
    near = NearPolicy(RequestMix((RequestKind(0, 2, 1000, (), 1),)))  # the workload wants pairs of GPUs
    two, three = node((1000, 1000)), node((1000, 1000, 1000))
    one_gpu = pod(cpu=0)
    assert near.score(two, one_gpu) == -1_000_000  # the last GPU of a pair is stranded
    assert near.score(three, one_gpu) == 0
    assert (near.window(one_gpu), near.window(pod(milli=500, cpu=0))) == (80_000, 20_000)
    nodes = [TraceNode("a", 64000, 1024, 2, "T4"), TraceNode("b", 64000, 1024, 2, "T4")]
    assert replay_once(nodes, [TracePod("p", 1000, 1, 1, 1000)], near, 42).unallocated_percent == 0
