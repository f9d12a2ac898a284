"""MIG geometry: which placements overlap, which sets can coexist, what is still free.

A layout is a set of (profile, placement) pairs. It is valid when no two placements share a memory slice,
no profile exceeds its instance limit and the compute slices fit the GPU.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent.devices.model import MigPlacement, MigProfile

COMPUTE_SLICES = 7


@dataclass(frozen=True, order=True)
class PlacedProfile:
    """One GPU instance, planned or existing: a profile at a placement."""

    start: int
    size: int
    profile: str
    gi_profile_id: int
    compute_slices: int

    @property
    def placement(self) -> MigPlacement:
        return MigPlacement(self.start, self.size)

    @classmethod
    def of(cls, profile: MigProfile, placement: MigPlacement) -> PlacedProfile:
        return cls(placement.start, placement.size, profile.name, profile.gi_profile_id, profile.compute_slices)


def is_valid_layout(
    layout: Iterable[PlacedProfile], profiles: Sequence[MigProfile], compute_slices: int = COMPUTE_SLICES
) -> bool:
    """True when the instances can coexist on one GPU with these profiles."""
    items = sorted(layout)
    limits = {p.gi_profile_id: p.max_instances for p in profiles}
    allowed = {(p.gi_profile_id, pl) for p in profiles for pl in p.placements}
    for item in items:
        if (item.gi_profile_id, item.placement) not in allowed:
            return False
    counts = Counter(i.gi_profile_id for i in items)
    if any(n > limits.get(pid, 0) for pid, n in counts.items()):
        return False
    if sum(i.compute_slices for i in items) > compute_slices:
        return False
    return all(a.start + a.size <= b.start for a, b in itertools.pairwise(items))


def free_placements(
    profile: MigProfile, occupied: Iterable[PlacedProfile], all_profiles: Sequence[MigProfile] = ()
) -> list[MigPlacement]:
    """Placements of `profile` that can be added next to `occupied`."""
    taken = list(occupied)
    profiles = list(all_profiles) or [profile]
    return [pl for pl in profile.placements if is_valid_layout([*taken, PlacedProfile.of(profile, pl)], profiles)]


def count_free_placements(profiles: Sequence[MigProfile], occupied: Iterable[PlacedProfile]) -> int:
    """How many placements of any profile could still be created: a measure of future flexibility."""
    taken = list(occupied)
    return sum(len(free_placements(p, taken, profiles)) for p in profiles)


def maximal_layouts(profiles: Sequence[MigProfile]) -> list[tuple[PlacedProfile, ...]]:
    """Every valid layout to which no further instance can be added, each sorted by start."""
    candidates = sorted(PlacedProfile.of(p, pl) for p in profiles for pl in p.placements)
    found: set[tuple[PlacedProfile, ...]] = set()

    def extend(layout: list[PlacedProfile], first: int) -> None:
        grew = False
        for i in range(len(candidates)):
            cand = candidates[i]
            if is_valid_layout([*layout, cand], profiles):
                grew = True
                if i >= first:
                    extend([*layout, cand], i + 1)
        if not grew:
            found.add(tuple(sorted(layout)))

    extend([], 0)
    return sorted(found)
