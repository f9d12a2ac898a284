"""What a claim's sharing configs ask of the node: time slices per GPU and one MPS daemon per claim.

Pure: no I/O. A MIG device's time slice cannot be set (the compute-policy time slice is per physical GPU),
so TimeSlicing on a MIG device sets none: its processes share it by the GPU's default scheduling. NVIDIA's
driver does the same (MigDeviceSharing.GetTimeSlicingConfig returns nil, so it runs no nvidia-smi for it);
the claim code tells the user in an Event. MPS on a MIG device leaves the parent GPU's compute mode alone:
the mode is per physical GPU and would constrain the other MIG devices on it, which may belong to other
claims.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.claimconfig.config import DeviceConfig, Mps, TimeSlicing

MIB = 1024 * 1024


class SharingConfigError(ValueError):
    """A sharing config this node cannot apply to the device it names."""


@dataclass(frozen=True)
class SharedDevice:
    """One prepared device with its effective config."""

    name: str  # gpu-0, gpu-0-mig-1g10gb-19-0
    uuid: str  # GPU-... or MIG-...
    gpu_uuid: str  # the physical GPU (itself for a full GPU)
    config: DeviceConfig

    @property
    def mig(self) -> bool:
        return self.uuid != self.gpu_uuid


@dataclass(frozen=True)
class MpsPlan:
    """The claim's MPS control daemon: the devices it serves and the limits it starts with."""

    devices: tuple[str, ...]  # uuids, CUDA_VISIBLE_DEVICES order
    exclusive_gpus: tuple[str, ...]  # full GPUs set to EXCLUSIVE_PROCESS
    active_thread_percentage: int | None = None
    pinned_memory_mib: tuple[tuple[str, int], ...] = ()  # (device uuid, MiB)


@dataclass(frozen=True)
class SharingPlan:
    timeslices: tuple[tuple[str, int], ...] = ()  # (GPU uuid, 0..3)
    mps: MpsPlan | None = None

    @property
    def empty(self) -> bool:
        return not self.timeslices and self.mps is None


def plan_sharing(devices: Sequence[SharedDevice]) -> SharingPlan:
    """Raises SharingConfigError for MPS limits that cannot work (below 1 MiB, two thread percentages)."""
    timeslices: dict[str, int] = {}
    mps_devices: list[SharedDevice] = []
    for d in devices:
        sharing = d.config.sharing
        if isinstance(sharing, TimeSlicing):
            if not d.mig and sharing.interval is not None:  # a MIG device gets no time slice (module docstring)
                timeslices[d.gpu_uuid] = sharing.interval.timeslice
        elif isinstance(sharing, Mps):
            mps_devices.append(d)
    return SharingPlan(tuple(timeslices.items()), _mps_plan(mps_devices) if mps_devices else None)


def _mps_plan(devices: Sequence[SharedDevice]) -> MpsPlan:
    percentages = {d.config.sharing.active_thread_percentage for d in devices if isinstance(d.config.sharing, Mps)}
    percentages.discard(None)
    if len(percentages) > 1:  # one daemon per claim has one default
        raise SharingConfigError(
            "the claim's MPS configs ask for different defaultActiveThreadPercentage values "
            f"({', '.join(str(p) for p in sorted(p for p in percentages if p is not None))}); "
            "one MPS daemon serves the whole claim"
        )
    limits = []
    for d in devices:
        if d.config.pinned_memory_limit is None:
            continue
        mib = int(d.config.pinned_memory_limit) // MIB
        if mib < 1:
            raise SharingConfigError(
                f"device {d.name}: MPS pinned memory limit {d.config.pinned_memory_limit.text!r} is below 1Mi"
            )
        limits.append((d.uuid, mib))
    return MpsPlan(
        devices=tuple(dict.fromkeys(d.uuid for d in devices)),
        exclusive_gpus=tuple(dict.fromkeys(d.gpu_uuid for d in devices if not d.mig)),
        active_thread_percentage=next(iter(percentages), None),
        pinned_memory_mib=tuple(limits),
    )
