"""What a claim's sharing configs ask of the node: time slices per GPU and one MPS daemon per claim.

Pure: no I/O. MIG devices cannot be time-sliced (a MIG device has no compute-policy time slice; NVIDIA's
driver only fails deep inside nvidia-smi), so asking for it is this claim's error. MPS on a MIG device
leaves the parent GPU's compute mode alone: the mode is per physical GPU and would constrain the other
MIG devices on it, which may belong to other claims.
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
    """Raises SharingConfigError for a MIG device asked to time-slice, or MPS limits below 1 MiB."""
    timeslices: dict[str, int] = {}
    mps_devices: list[SharedDevice] = []
    for d in devices:
        sharing = d.config.sharing
        if isinstance(sharing, TimeSlicing):
            if d.mig or sharing.interval is None:
                raise SharingConfigError(
                    f"device {d.name} is a MIG device: MIG devices cannot be time-sliced (a time slice is set "
                    "per physical GPU); use strategy MPS, or no sharing config, for MIG devices"
                )
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
            raise SharingConfigError(f"device {d.name}: MPS pinned memory limit "
                                     f"{d.config.pinned_memory_limit.text!r} is below 1Mi")  # fmt: skip
        limits.append((d.uuid, mib))
    return MpsPlan(
        devices=tuple(dict.fromkeys(d.uuid for d in devices)),
        exclusive_gpus=tuple(dict.fromkeys(d.gpu_uuid for d in devices if not d.mig)),
        active_thread_percentage=next(iter(percentages), None),
        pinned_memory_mib=tuple(limits),
    )
