"""Frozen dataclasses describing one node's GPUs, MIG geometry, MIG devices and NVLink domains."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from agent.devices.names import mig_device_name


class ComputeMode(enum.Enum):
    """NVML compute modes (nvmlComputeMode_t)."""

    DEFAULT = 0
    EXCLUSIVE_THREAD = 1  # deprecated by NVIDIA, still reported by old drivers
    PROHIBITED = 2
    EXCLUSIVE_PROCESS = 3


@dataclass(frozen=True, order=True)
class MigPlacement:
    """Where a GPU instance sits, in memory slices: it occupies slices start .. start+size-1."""

    start: int
    size: int

    @property
    def slices(self) -> range:
        return range(self.start, self.start + self.size)

    def overlaps(self, other: MigPlacement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


@dataclass(frozen=True)
class MigProfile:
    """One GPU-instance profile a GPU supports, as NVML reports it.

    `profile_enum` is the NVML_GPU_INSTANCE_PROFILE_* index passed to GetGpuInstanceProfileInfo;
    `gi_profile_id` is the driver's `info.id` used everywhere else (placements, create, device names).
    """

    name: str  # "1g.10gb", "1g.10gb+me"
    profile_enum: int
    gi_profile_id: int
    compute_slices: int
    memory_slices: int
    max_instances: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    placements: tuple[MigPlacement, ...]

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * 1024 * 1024


@dataclass(frozen=True)
class MigDevice:
    """A MIG device that exists now: one GPU instance with its (single, full-size) compute instance."""

    uuid: str  # "MIG-..."
    parent_uuid: str
    parent_minor: int
    parent_index: int
    profile: str
    gi_profile_id: int
    placement: MigPlacement
    gpu_instance_id: int
    compute_instance_id: int
    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int

    @property
    def name(self) -> str:
        """The canonical device name (gpu-<minor>-mig-<profile>-<giProfileId>-<start>)."""
        return mig_device_name(self.parent_minor, self.profile, self.gi_profile_id, self.placement.start)


@dataclass(frozen=True)
class GpuInstance:
    """A MIG GPU instance that exists now, with or without compute instances: it holds its placement."""

    gpu_instance_id: int
    gi_profile_id: int
    profile: str
    placement: MigPlacement


@dataclass(frozen=True)
class UnavailableGpu:
    """A GPU NVML lists but discovery had to skip (lost, needs reset): reported, never advertised."""

    index: int
    reason: str


@dataclass(frozen=True)
class FabricInfo:
    """An NVLink fabric clique the GPU is attached to (GB200/GH200 multi-node NVLink)."""

    cluster_uuid: str
    clique_id: int
    degraded: bool = False  # the fabric manager reports degraded bandwidth (healthMask DEGRADED_BW)

    @property
    def domain_id(self) -> str:
        return f"{self.cluster_uuid}.{self.clique_id}"


@dataclass(frozen=True)
class Gpu:
    """One full GPU as discovered through NVML."""

    index: int
    minor: int
    uuid: str  # "GPU-..."
    product_name: str  # "NVIDIA H100 80GB HBM3"
    brand: str  # "Nvidia", "Tesla", ...
    architecture: str  # "Hopper"
    cuda_compute_capability: str  # "9.0"
    memory_bytes: int
    pci_bus_id: str  # "0000:18:00.0", lower case, 4-digit domain
    pci_device_id: int  # device << 16 | vendor, e.g. 0x233010DE
    pcie_root: str | None = None  # "pci0000:17"
    numa_node: int | None = None
    compute_mode: ComputeMode = ComputeMode.DEFAULT
    mps_server: bool = False  # an MPS server (nvidia-cuda-mps-server) runs on it
    mig_capable: bool = False
    mig_enabled: bool = False  # current mode
    mig_pending: bool = False  # pending mode (differs from current until reset on Ampere)
    mig_profiles: tuple[MigProfile, ...] = ()
    gpu_instances: tuple[GpuInstance, ...] = ()  # existing GIs, including those without a MIG device
    nvlink_peers: tuple[str, ...] = ()  # PCI bus ids at the other end of active NVLinks
    fabric: FabricInfo | None = None
    # why its fabric is broken (agent.devices.fabric.fabric_fault), None when whole or without one
    fabric_fault: str | None = None
    nvlink_domain: str = ""  # filled by topology.assign_nvlink_domains
    time_slicing_supported: bool = True
    mps_supported: bool = True

    def profile(self, name_or_id: str | int) -> MigProfile | None:
        for p in self.mig_profiles:
            if name_or_id in (p.name, p.gi_profile_id):
                return p
        return None


@dataclass(frozen=True)
class NvlinkDomain:
    """GPUs that reach each other over NVLink: one node-local component, or a fabric clique."""

    id: str
    gpu_minors: tuple[int, ...]
    fabric: bool = False


@dataclass(frozen=True)
class Inventory:
    """Everything the agent knows about one node's GPUs at one moment."""

    driver_version: str  # "550.54.15"
    cuda_driver_version: str  # "12.4"
    nvml_version: str = ""
    gpus: tuple[Gpu, ...] = ()
    mig_devices: tuple[MigDevice, ...] = ()
    nvlink_domains: tuple[NvlinkDomain, ...] = ()
    unavailable_gpus: tuple[UnavailableGpu, ...] = ()
    _by_minor: dict[int, Gpu] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_minor.update({g.minor: g for g in self.gpus})

    def gpu(self, minor: int) -> Gpu | None:
        return self._by_minor.get(minor)

    def mig_devices_of(self, parent_minor: int) -> tuple[MigDevice, ...]:
        return tuple(m for m in self.mig_devices if m.parent_minor == parent_minor)
