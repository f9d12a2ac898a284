"""MIG geometry: overlap, valid layouts, free placements and maximal layouts, checked by brute force."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.devices.geometry import (
    PlacedProfile,
    count_free_placements,
    free_placements,
    is_valid_layout,
    maximal_layouts,
)
from agent.devices.model import MigPlacement, MigProfile


def profile(
    name: str, enum: int, gi_id: int, compute: int, memory: int, max_instances: int, starts: Sequence[int]
) -> MigProfile:
    return MigProfile(
        name=name,
        profile_enum=enum,
        gi_profile_id=gi_id,
        compute_slices=compute,
        memory_slices=memory,
        max_instances=max_instances,
        memory_mib=memory * 10240,
        multiprocessors=16 * compute,
        copy_engines=compute,
        decoders=0,
        encoders=0,
        jpeg_engines=0,
        ofa_engines=0,
        placements=tuple(MigPlacement(s, memory) for s in starts),
    )


# H100 80GB as the MIG user guide lists it (enum, info.id, compute/memory slices, max, placement starts).
P1G = profile("1g.10gb", 0, 19, 1, 1, 7, range(7))
P1G_ME = profile("1g.10gb+me", 7, 20, 1, 1, 1, range(7))
P1G_20 = profile("1g.20gb", 9, 15, 1, 2, 4, (0, 2, 4, 6))
P2G = profile("2g.20gb", 1, 14, 2, 2, 3, (0, 2, 4))
P3G = profile("3g.40gb", 2, 9, 3, 4, 2, (0, 4))
P4G = profile("4g.40gb", 3, 5, 4, 4, 1, (0,))
P7G = profile("7g.80gb", 4, 0, 7, 8, 1, (0,))
CLASSIC = (P1G, P2G, P3G, P4G, P7G)
H100 = (P1G, P1G_ME, P1G_20, P2G, P3G, P4G, P7G)


def candidates(profiles: Sequence[MigProfile]) -> list[PlacedProfile]:
    return [PlacedProfile.of(p, pl) for p in profiles for pl in p.placements]


def brute_valid(layout: Sequence[PlacedProfile], profiles: Sequence[MigProfile]) -> bool:
    """Independent rule check: memory slices used at most once, 7 compute slices, per-profile limits."""
    limits = {p.gi_profile_id: p.max_instances for p in profiles}
    used = [s for item in layout for s in range(item.start, item.start + item.size)]
    counts = Counter(item.gi_profile_id for item in layout)
    return (
        len(used) == len(set(used))
        and sum(item.compute_slices for item in layout) <= 7
        and all(n <= limits[pid] for pid, n in counts.items())
    )


def brute_maximal(profiles: Sequence[MigProfile]) -> set[tuple[PlacedProfile, ...]]:
    """Every subset of candidates (pruned only where already invalid) that cannot take one more."""
    cands = candidates(profiles)
    found = set()

    def walk(i: int, chosen: list[PlacedProfile]) -> None:
        if i == len(cands):
            if not any(c not in chosen and brute_valid([*chosen, c], profiles) for c in cands):
                found.add(tuple(sorted(chosen)))
            return
        if brute_valid([*chosen, cands[i]], profiles):
            walk(i + 1, [*chosen, cands[i]])
        walk(i + 1, chosen)

    walk(0, [])
    return found


def test_placements_overlap_only_when_they_share_a_memory_slice() -> None:
    assert MigPlacement(0, 4).overlaps(MigPlacement(2, 2))
    assert MigPlacement(2, 2).overlaps(MigPlacement(0, 4))
    assert not MigPlacement(0, 4).overlaps(MigPlacement(4, 4))
    assert not MigPlacement(6, 1).overlaps(MigPlacement(0, 6))
    assert list(MigPlacement(4, 2).slices) == [4, 5]


def test_a_full_gpu_layout_is_valid_and_overlapping_instances_are_not() -> None:
    assert is_valid_layout([PlacedProfile.of(P4G, MigPlacement(0, 4)), PlacedProfile.of(P3G, MigPlacement(4, 4))], H100)
    # Tried: a 2g instance over the first half of a 3g instance.
    assert not is_valid_layout(
        [PlacedProfile.of(P3G, MigPlacement(0, 4)), PlacedProfile.of(P2G, MigPlacement(2, 2))], H100
    )


def test_layout_rejects_placements_the_profile_does_not_offer() -> None:
    # Tried: a 2g instance at an odd start, which NVML never offers.
    assert not is_valid_layout([PlacedProfile.of(P2G, MigPlacement(1, 2))], H100)


def test_layout_rejects_more_instances_than_the_profile_allows() -> None:
    # Tried: two +me instances; only one GPU instance may own the media engines.
    two_me = [PlacedProfile.of(P1G_ME, MigPlacement(0, 1)), PlacedProfile.of(P1G_ME, MigPlacement(1, 1))]
    assert not is_valid_layout(two_me, H100)


def test_free_placements_next_to_a_3g_instance() -> None:
    occupied = [PlacedProfile.of(P3G, MigPlacement(0, 4))]
    assert free_placements(P2G, occupied, H100) == [MigPlacement(4, 2)]
    assert free_placements(P1G, occupied, H100) == [MigPlacement(s, 1) for s in (4, 5, 6)]
    assert free_placements(P3G, occupied, H100) == [MigPlacement(4, 4)]
    assert free_placements(P4G, occupied, H100) == []
    assert free_placements(P7G, occupied, H100) == []


def test_an_empty_gpu_offers_every_placement() -> None:
    assert count_free_placements(H100, []) == sum(len(p.placements) for p in H100) == 25


def test_the_classic_five_profiles_have_19_maximal_layouts() -> None:
    found = maximal_layouts(CLASSIC)
    assert len(found) == 19
    assert set(found) == brute_maximal(CLASSIC)


def test_maximal_layouts_of_all_h100_profiles_match_brute_force() -> None:
    found = maximal_layouts(H100)
    assert len(found) == len(set(found))
    assert set(found) == brute_maximal(H100)


layouts = st.lists(st.sampled_from(candidates(H100)), max_size=8, unique=True)


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_no_accepted_layout_overlaps(layout: list[PlacedProfile]) -> None:
    if is_valid_layout(layout, H100):
        for a, b in itertools.combinations(layout, 2):
            assert not a.placement.overlaps(b.placement)
    assert is_valid_layout(layout, H100) == brute_valid(layout, H100)


@settings(max_examples=200, deadline=None)
@given(layouts, st.sampled_from(H100))
def test_free_placements_are_exactly_those_that_fit(layout: list[PlacedProfile], p: MigProfile) -> None:
    if not brute_valid(layout, H100):
        return
    expected = [pl for pl in p.placements if brute_valid([*layout, PlacedProfile.of(p, pl)], H100)]
    assert free_placements(p, layout, H100) == expected


@pytest.mark.parametrize("layout", maximal_layouts(CLASSIC))
def test_every_maximal_layout_is_valid_and_full(layout: tuple[PlacedProfile, ...]) -> None:
    assert is_valid_layout(layout, CLASSIC)
    assert all(not free_placements(p, layout, CLASSIC) for p in CLASSIC)
