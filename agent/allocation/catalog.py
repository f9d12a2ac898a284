"""The devices one node can hand out right now, with their DRA attributes and capacities.

Whole GPUs (not in MIG mode), existing MIG devices, and possible MIG placements (partitionable devices
that would be created on prepare). Devices that are allocated, prepared, reserved or unhealthy are left
out; a GPU used by shared (fractional) claims is offered only to further fractions.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from agent.allocation.cel import device_variable
from agent.allocation.fragmentation import MILLI
from agent.devices.geometry import PlacedProfile, free_placements
from agent.devices.model import Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from agent.devices.names import canonical, gpu_device_name, mig_device_name
from agent.slices import build as slice_devices
from agent.slices.build import DEFAULT_DRIVER

DRIVER = DEFAULT_DRIVER  # the local allocator serves the default driver name


@dataclass(frozen=True)
class NodeUsage:
    """What is taken on one node, by device name. `shared_milli`: GPU fraction used on shared GPUs.

    Names are kept in their canonical spelling: an allocation written `gpu-01` takes `gpu-1`, the device it
    names, not a device of its own that the allocator would never offer."""

    allocated: frozenset[str] = frozenset()
    prepared: frozenset[str] = frozenset()
    reserved: frozenset[str] = frozenset()
    unhealthy: frozenset[str] = frozenset()
    shared_milli: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("allocated", "prepared", "reserved", "unhealthy"):
            names: frozenset[str] = getattr(self, name)
            object.__setattr__(self, name, frozenset(map(canonical, names)))
        shared: dict[str, int] = {}
        for device, milli in self.shared_milli.items():
            shared[canonical(device)] = shared.get(canonical(device), 0) + milli
        object.__setattr__(self, "shared_milli", shared)

    @cached_property
    def taken(self) -> frozenset[str]:  # asked once per device and placement: computed once
        return self.allocated | self.prepared | self.reserved | self.unhealthy


@dataclass(frozen=True)
class Candidate:
    name: str
    kind: str  # "gpu" or "mig"
    gpu: Gpu  # the GPU, or the MIG device's parent
    nvlink_domain: str
    env: Mapping[str, Any]  # DRA CEL `device` variable
    mig_profile: MigProfile | None = None
    placement: MigPlacement | None = None
    exists: bool = True  # False: a possible MIG placement, created on prepare
    free_milli: int = MILLI  # for whole GPUs: what a fraction may still take


def _env(device: Mapping[str, Any]) -> Mapping[str, Any]:
    """DRA's CEL `device` variable for a device exactly as the ResourceSlices publish it, so a selector
    means the same here as in kube-scheduler."""
    return device_variable(DRIVER, device)


# The CEL `device` of each whole GPU, per inventory (frozen, so its GPUs' attributes never change): building
# it (attributes, quantities) is most of a fit's cost on a node asked often, such as a simulator's. Keyed by
# the inventory's identity; an entry goes when its inventory does, before the id can be reused.
_GPU_ENVS: dict[int, dict[int, Mapping[str, Any]]] = {}


def _gpu_env(inv: Inventory, gpu: Gpu) -> Mapping[str, Any]:
    envs = _GPU_ENVS.get(id(inv))
    if envs is None:
        envs = _GPU_ENVS[id(inv)] = {}
        weakref.finalize(inv, _GPU_ENVS.pop, id(inv), None)
    env = envs.get(gpu.minor)
    if env is None:
        env = envs[gpu.minor] = _env(slice_devices.gpu_device(inv, gpu))
    return env


def occupied_layout(gpu: Gpu, inv: Inventory, usage: NodeUsage) -> list[PlacedProfile]:
    """MIG instances that exist on `gpu` (as MIG devices, or as GPU instances without a compute instance) or
    are promised as possible placements (by name in usage)."""
    layout = []
    for m in inv.mig_devices_of(gpu.minor):
        profile = gpu.profile(m.gi_profile_id)
        if profile is not None:
            layout.append(PlacedProfile.of(profile, m.placement))
    held = {p.placement for p in layout}
    for gi in gpu.gpu_instances:
        profile = gpu.profile(gi.gi_profile_id)
        if profile is not None and gi.placement not in held:
            layout.append(PlacedProfile.of(profile, gi.placement))
    existing = {mig_device_name(gpu.minor, p.profile, p.gi_profile_id, p.start) for p in layout}
    for profile in gpu.mig_profiles:
        for pl in profile.placements:
            name = mig_device_name(gpu.minor, profile.name, profile.gi_profile_id, pl.start)
            if name not in existing and name in usage.taken - usage.unhealthy:
                layout.append(PlacedProfile.of(profile, pl))
    return layout


def mig_candidate(
    gpu: Gpu, inv: Inventory, profile: MigProfile, pl: MigPlacement, mig: MigDevice | None = None
) -> Candidate:
    """An existing MIG device (`mig`), or the possible one `profile` at `pl`."""
    device = (
        slice_devices.mig_device(inv, gpu, mig=mig)
        if mig
        else slice_devices.mig_device(inv, gpu, profile=profile, placement=pl)
    )
    return Candidate(device["name"], "mig", gpu, gpu.nvlink_domain, _env(device), profile, pl, mig is not None)


def candidates(inv: Inventory, usage: NodeUsage) -> list[Candidate]:
    """Every device that could be given out now, in a stable order (GPU minor, then placement)."""
    out: list[Candidate] = []
    for gpu in sorted(inv.gpus, key=lambda g: g.minor):
        name = gpu_device_name(gpu.minor)
        if name in usage.unhealthy:
            continue  # an unhealthy GPU gives out nothing, MIG devices included
        if not gpu.mig_enabled:
            if name in usage.taken:
                continue
            free = MILLI - usage.shared_milli.get(name, 0)
            env = _gpu_env(inv, gpu)
            out.append(Candidate(name, "gpu", gpu, gpu.nvlink_domain, env, free_milli=free))
            continue
        layout = occupied_layout(gpu, inv, usage)
        for m in inv.mig_devices_of(gpu.minor):
            profile = gpu.profile(m.gi_profile_id)
            cand = profile and mig_candidate(gpu, inv, profile, m.placement, m)
            if cand and cand.name not in usage.taken:
                out.append(cand)
        for profile in gpu.mig_profiles:
            for pl in free_placements(profile, layout, gpu.mig_profiles):
                cand = mig_candidate(gpu, inv, profile, pl)
                if cand.name not in usage.taken:
                    out.append(cand)
    return out
