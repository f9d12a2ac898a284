"""The devices one node can hand out right now, with their DRA attributes and capacities.

Whole GPUs (not in MIG mode), existing MIG devices, and possible MIG placements (partitionable devices
that would be created on prepare). Devices that are allocated, prepared, reserved or unhealthy are left
out; a GPU used by shared (fractional) claims is offered only to further fractions.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.allocation.cel import quantity_value, semver_value
from agent.devices.geometry import PlacedProfile, free_placements
from agent.devices.model import Gpu, Inventory, MigPlacement, MigProfile
from agent.devices.names import gpu_device_name, mig_device_name
from agent.slices.build import DEFAULT_DRIVER, semver

DRIVER = DEFAULT_DRIVER  # the local allocator serves the default driver name
GPU_CLASS = "gpu.nvidia.com"
MIG_CLASS = "mig.nvidia.com"
MILLI = 1000


@dataclass(frozen=True)
class NodeUsage:
    """What is taken on one node, by device name. `shared_milli`: GPU fraction used on shared GPUs."""

    allocated: frozenset[str] = frozenset()
    prepared: frozenset[str] = frozenset()
    reserved: frozenset[str] = frozenset()
    unhealthy: frozenset[str] = frozenset()
    shared_milli: Mapping[str, int] = field(default_factory=dict)

    @property
    def taken(self) -> frozenset[str]:
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


def _gpu_attributes(gpu: Gpu, inv: Inventory) -> dict[str, Any]:
    versions = {
        "cudaComputeCapability": gpu.cuda_compute_capability, "driverVersion": inv.driver_version,
        "cudaDriverVersion": inv.cuda_driver_version,
    }
    return {
        "productName": gpu.product_name, "brand": gpu.brand, "architecture": gpu.architecture,
        # Versions as the slices publish them: semver, left out where the driver's text is not numeric.
        **{k: semver_value(s) for k, raw in versions.items() if (s := semver(raw)) is not None},
        "nvlinkDomain": gpu.nvlink_domain,
        "index": gpu.index, "minor": gpu.minor, "numaNode": gpu.numa_node if gpu.numa_node is not None else -1,
    }


def _env(attributes: dict[str, Any], capacity: dict[str, int]) -> dict[str, Any]:
    """DRA's CEL `device` variable (agent.allocation.cel), capacities as quantities."""
    quantities = {k: quantity_value(str(v)) for k, v in capacity.items()}
    return {"driver": DRIVER, "attributes": {DRIVER: attributes}, "capacity": {DRIVER: quantities}}


def occupied_layout(gpu: Gpu, inv: Inventory, usage: NodeUsage) -> list[PlacedProfile]:
    """MIG instances that exist on `gpu` or are promised as possible placements (by name in usage)."""
    layout = []
    for m in inv.mig_devices_of(gpu.minor):
        profile = gpu.profile(m.gi_profile_id)
        if profile is not None:
            layout.append(PlacedProfile.of(profile, m.placement))
    existing = {mig_device_name(gpu.minor, p.profile, p.gi_profile_id, p.start) for p in layout}
    for profile in gpu.mig_profiles:
        for pl in profile.placements:
            name = mig_device_name(gpu.minor, profile.name, profile.gi_profile_id, pl.start)
            if name not in existing and name in usage.taken - usage.unhealthy:
                layout.append(PlacedProfile.of(profile, pl))
    return layout


def mig_candidate(gpu: Gpu, inv: Inventory, profile: MigProfile, pl: MigPlacement, exists: bool) -> Candidate:
    attrs = _gpu_attributes(gpu, inv) | {"type": "mig", "profile": profile.name, "parentUUID": gpu.uuid}
    cap = {"memory": profile.memory_bytes, "multiprocessors": profile.multiprocessors}
    name = mig_device_name(gpu.minor, profile.name, profile.gi_profile_id, pl.start)
    return Candidate(name, "mig", gpu, gpu.nvlink_domain, _env(attrs, cap), profile, pl, exists)


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
            attrs = _gpu_attributes(gpu, inv) | {"type": "gpu", "uuid": gpu.uuid}
            free = MILLI - usage.shared_milli.get(name, 0)
            out.append(Candidate(name, "gpu", gpu, gpu.nvlink_domain,
                                 _env(attrs, {"memory": gpu.memory_bytes}), free_milli=free))
            continue
        layout = occupied_layout(gpu, inv, usage)
        for m in inv.mig_devices_of(gpu.minor):
            profile = gpu.profile(m.gi_profile_id)
            cand = profile and mig_candidate(gpu, inv, profile, m.placement, True)
            if cand and cand.name not in usage.taken:
                out.append(cand)
        for profile in gpu.mig_profiles:
            for pl in free_placements(profile, layout, gpu.mig_profiles):
                cand = mig_candidate(gpu, inv, profile, pl, False)
                if cand.name not in usage.taken:
                    out.append(cand)
    return out
