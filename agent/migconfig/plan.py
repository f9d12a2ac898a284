"""From a GPU's current MIG layout to the wanted one, in steps NVML accepts. Pure: no I/O.

Every instance is created at a placement chosen here with the geometry (agent.devices.geometry), never by
the driver's auto-placement, whose order depends on what is already there (the MIG user guide's
`-cgi 19,19,14,9` fails with InsufficientResources where `9,19,14,19` works). The steps are: destroy what
does not stay, switch the MIG mode, create what is missing. All destroys come first, and the wanted layout
is valid as a whole, so every create finds its placement free and its profile under its limits: any subset
of a valid layout is valid. Instances that already sit where the wanted layout can keep them stay, so a
layout that already matches plans no step at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent.devices.geometry import COMPUTE_SLICES, PlacedProfile, is_valid_layout
from agent.devices.model import Gpu, Inventory, MigDevice, MigProfile
from agent.migconfig.desired import WantedLayout


class LayoutDoesNotFit(ValueError):
    """The wanted instances cannot all sit on the GPU at once."""


@dataclass(frozen=True)
class GpuPlan:
    """The NVML steps that take one GPU to its wanted layout, in order: destroy, set mode, create."""

    minor: int
    index: int
    uuid: str
    destroy: tuple[PlacedProfile, ...] = ()  # GPU instances to remove, with their compute instances
    mig_mode: bool | None = None  # the MIG mode to set, None when current and pending mode are right
    create: tuple[PlacedProfile, ...] = ()  # GPU instances to create, each with a full-size compute instance
    layout: tuple[PlacedProfile, ...] = ()  # the GPU's instances once done

    @property
    def changes(self) -> bool:
        return bool(self.destroy or self.create or self.mig_mode is not None)

    def describe(self) -> str:
        parts = []
        if self.destroy:
            parts.append("destroy " + ", ".join(_show(p) for p in self.destroy))
        if self.mig_mode is not None:
            parts.append(f"MIG mode {'on' if self.mig_mode else 'off'}")
        if self.create:
            parts.append("create " + ", ".join(_show(p) for p in self.create))
        return f"GPU {self.index}: " + ("; ".join(parts) or "no change")


def _show(p: PlacedProfile) -> str:
    return f"{p.profile}@{p.start}"


def plan_node(inventory: Inventory, wanted: dict[int, WantedLayout]) -> tuple[GpuPlan, ...]:
    """A plan for every GPU `wanted` covers, by index; GPUs already right get plans without changes.

    Raises:
        LayoutDoesNotFit: the wanted instances of some GPU cannot coexist.
    """
    plans = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        if gpu.minor in wanted:
            plans.append(plan_gpu(gpu, inventory.mig_devices_of(gpu.minor), wanted[gpu.minor]))
    return tuple(plans)


def plan_gpu(gpu: Gpu, mig_devices: Sequence[MigDevice], wanted: WantedLayout) -> GpuPlan:
    """The steps from the GPU as discovered (MIG mode, GPU instances, MIG devices) to `wanted`.

    A GPU instance counts as in place only with exactly one compute instance spanning it (a MIG device with
    the profile's multiprocessors); one without, or split into smaller compute instances, is re-created.

    Raises:
        LayoutDoesNotFit: the wanted instances cannot coexist on this GPU, or it lacks a profile.
    """
    mode = wanted.mig_enabled if (gpu.mig_enabled, gpu.mig_pending) != (wanted.mig_enabled,) * 2 else None
    existing = _existing(gpu, mig_devices)
    if not wanted.mig_enabled:
        return GpuPlan(gpu.minor, gpu.index, gpu.uuid, destroy=tuple(sorted(existing)), mig_mode=mode)
    if wanted.mode_only:  # dynamic MIG: the instances are the claims', not the config's
        return GpuPlan(gpu.minor, gpu.index, gpu.uuid, mig_mode=mode, layout=tuple(sorted(existing)))
    profiles = _profiles(gpu, wanted)
    # A GPU whose MIG mode is only pending has no instances that count: a reset drops them.
    keepable = [p for p, whole in existing.items() if whole] if gpu.mig_enabled else []
    layout = choose_layout(gpu.mig_profiles, profiles, keepable)
    if layout is None:
        raise LayoutDoesNotFit(f"GPU {gpu.index} ({gpu.product_name}) cannot hold {wanted.describe()} at once")
    kept = set(layout) & set(keepable)
    return GpuPlan(
        gpu.minor,
        gpu.index,
        gpu.uuid,
        destroy=tuple(sorted(p for p in existing if p not in kept)),
        mig_mode=mode,
        create=tuple(sorted((p for p in layout if p not in kept), key=_create_order)),
        layout=layout,
    )


def _create_order(p: PlacedProfile) -> tuple[int, int, str]:
    return (-p.size, p.start, p.profile)


def _existing(gpu: Gpu, mig_devices: Sequence[MigDevice]) -> dict[PlacedProfile, bool]:
    """Every GPU instance on the GPU, and whether it is whole (one full-size compute instance)."""
    out: dict[PlacedProfile, bool] = {}
    for gi in gpu.gpu_instances:
        profile = gpu.profile(gi.gi_profile_id)
        placed = PlacedProfile(
            gi.placement.start,
            gi.placement.size,
            gi.profile,
            gi.gi_profile_id,
            profile.compute_slices if profile else COMPUTE_SLICES,
        )
        devices = [m for m in mig_devices if m.gpu_instance_id == gi.gpu_instance_id]
        out[placed] = (
            profile is not None and len(devices) == 1 and devices[0].multiprocessors == profile.multiprocessors
        )
    return out


def _profiles(gpu: Gpu, wanted: WantedLayout) -> list[MigProfile]:
    """The wanted instances as a list of profiles, largest first (fewest placements to try first)."""
    out = []
    for name, count in wanted.devices:
        profile = gpu.profile(name)
        if profile is None:
            raise LayoutDoesNotFit(f"GPU {gpu.index} ({gpu.product_name}) has no MIG profile {name}")
        out.extend([profile] * count)
    return sorted(out, key=lambda p: (-p.memory_slices, -p.compute_slices, p.gi_profile_id))


def choose_layout(
    all_profiles: Sequence[MigProfile], wanted: Sequence[MigProfile], keep: Iterable[PlacedProfile] = ()
) -> tuple[PlacedProfile, ...] | None:
    """A valid layout with exactly the `wanted` instances that keeps as many of `keep` as possible; None when
    they cannot coexist. Deterministic: among equally good layouts, the first in placement order."""
    keepable = set(keep)
    best: list[tuple[PlacedProfile, ...]] = []
    best_kept = -1
    # keep_left[i]: how many of instances i.. could still be kept, per profile at most its keepable ones.
    keep_left = [0] * (len(wanted) + 1)
    for i in range(len(wanted) - 1, -1, -1):
        pid = wanted[i].gi_profile_id
        later = sum(1 for w in wanted[i:] if w.gi_profile_id == pid)
        keep_left[i] = keep_left[i + 1] + (later <= sum(1 for k in keepable if k.gi_profile_id == pid))
    most = keep_left[0]

    def search(i: int, chosen: list[PlacedProfile], kept: int) -> bool:
        nonlocal best_kept
        if kept + keep_left[i] <= best_kept:
            return False
        if i == len(wanted):
            best[:] = [tuple(sorted(chosen))]
            best_kept = kept
            return kept == most  # nothing can beat keeping every keepable instance
        profile = wanted[i]
        # Instances of one profile are placed in ascending order: the same set in another order is no new layout.
        floor = max((c.start for c in chosen if c.gi_profile_id == profile.gi_profile_id), default=-1)
        candidates = [PlacedProfile.of(profile, pl) for pl in profile.placements if pl.start > floor]
        candidates.sort(key=lambda c: (c not in keepable, c.start))
        for cand in candidates:
            if is_valid_layout([*chosen, cand], all_profiles) and search(
                i + 1, [*chosen, cand], kept + (cand in keepable)
            ):
                return True
        return False

    search(0, [], 0)
    return best[0] if best else None
