"""From NVML to the pure inventory: identity, memory, PCI, MIG geometry and instances, NVLink, fabric.

Call inside `nvml_session()`. Features a GPU or an old driver lacks (NotSupported, FunctionNotFound)
degrade to "absent"; a lost GPU is skipped and listed in `Inventory.unavailable_gpus`; anything else is
raised as an `agent.nvml.errors.NvmlError`.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Callable
from ctypes import byref, c_uint
from typing import Any, TypeVar

import pynvml

from agent.devices.fabric import fabric_fault
from agent.devices.model import (
    ComputeMode,
    FabricInfo,
    Gpu,
    GpuInstance,
    Inventory,
    MigDevice,
    MigPlacement,
    MigProfile,
    UnavailableGpu,
)
from agent.devices.topology import assign_nvlink_domains
from agent.nvml.errors import FunctionMissing, InvalidArgument, NotFound, NotSupported, NvmlError, call
from agent.nvml.sysfs import PciTopology

log = logging.getLogger(__name__)

T = TypeVar("T")

_BRANDS = {
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}

_ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada Lovelace",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
}

# Profile enums whose name carries a suffix; only needed when the driver lacks the v2 info (no name).
_SUFFIXES = {pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1: "+me"}

MEMORY_SLICES = 8


def _optional(doing: str, fn: Callable[..., T], *args: Any) -> T | None:
    """The call's result, or None where the GPU or the driver does not offer it."""
    try:
        return call(doing, fn, *args)
    except NotSupported:  # FunctionMissing included: an older driver
        return None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML's "00000000:18:00.0" -> "0000:18:00.0", lower case, as sysfs and Kubernetes write it."""
    text = _text(bus_id).strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or not rest:
        raise ValueError(f"{text!r} is not a PCI bus id (domain:bus:device.function)")
    return f"{int(domain, 16):04x}:{rest}"


def fallback_pcie_root(bus_id: str) -> str:
    """Without sysfs, name the root after the device's own domain and bus: stable, unique per bus."""
    domain, bus, _ = bus_id.split(":", 2)
    return f"pci{domain}:{bus}"


def cuda_version_text(version: int) -> str:
    """NVML's 12040 -> "12.4"."""
    return f"{version // 1000}.{version % 1000 // 10}"


def discover(topology: PciTopology | None = None) -> Inventory:
    """Everything NVML says about this node's GPUs. `topology`: sysfs facts, None to derive them."""
    driver = _text(call("reading the driver version", pynvml.nvmlSystemGetDriverVersion))
    nvml_version = _optional("reading the NVML version", pynvml.nvmlSystemGetNVMLVersion)
    count = call("counting GPUs", pynvml.nvmlDeviceGetCount)
    gpus: list[Gpu] = []
    mig_devices: list[MigDevice] = []
    unavailable: list[UnavailableGpu] = []
    for index in range(count):
        try:
            gpu, migs = _discover_gpu(index, topology)
        except NvmlError as exc:  # lost, needs a reset, or any fault of this GPU alone: serve the others
            log.warning("skipping GPU %d: %s", index, exc)
            unavailable.append(UnavailableGpu(index, str(exc)))
            continue
        gpus.append(gpu)
        mig_devices.extend(migs)
    stamped, domains = assign_nvlink_domains(gpus)
    return Inventory(
        driver_version=driver,
        cuda_driver_version=_cuda_driver_version(),
        nvml_version=_text(nvml_version or ""),
        gpus=stamped,
        mig_devices=tuple(mig_devices),
        nvlink_domains=domains,
        unavailable_gpus=tuple(unavailable),
    )


def _cuda_driver_version() -> str:
    version = _optional("reading the CUDA driver version", pynvml.nvmlSystemGetCudaDriverVersion_v2)
    if version is None:
        version = call("reading the CUDA driver version", pynvml.nvmlSystemGetCudaDriverVersion)
    return cuda_version_text(version)


def _discover_gpu(index: int, topology: PciTopology | None) -> tuple[Gpu, list[MigDevice]]:
    h = call(f"opening GPU {index}", pynvml.nvmlDeviceGetHandleByIndex, index)
    what = f"GPU {index}"
    uuid_ = _text(call(f"reading the uuid of {what}", pynvml.nvmlDeviceGetUUID, h))
    minor = _optional(f"reading the minor number of {what}", pynvml.nvmlDeviceGetMinorNumber, h)
    pci = call(f"reading the PCI info of {what}", pynvml.nvmlDeviceGetPciInfo, h)
    bus_id = normalize_bus_id(pci.busId)
    brand = _optional(f"reading the brand of {what}", pynvml.nvmlDeviceGetBrand, h)
    arch = _optional(f"reading the architecture of {what}", pynvml.nvmlDeviceGetArchitecture, h)
    major, minor_cc = call(f"reading the compute capability of {what}", pynvml.nvmlDeviceGetCudaComputeCapability, h)
    memory = call(f"reading the memory of {what}", pynvml.nvmlDeviceGetMemoryInfo, h)
    mode = _optional(f"reading the compute mode of {what}", pynvml.nvmlDeviceGetComputeMode, h)
    mig_mode = _optional(f"reading the MIG mode of {what}", pynvml.nvmlDeviceGetMigMode, h)
    mig_enabled = bool(mig_mode and mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
    profiles = _mig_profiles(h, what, int(memory.total)) if mig_mode is not None else ()
    minor_number = index if minor is None else int(minor)
    instances: tuple[GpuInstance, ...] = ()
    migs: list[MigDevice] = []
    if mig_enabled:
        instances = _gpu_instances(h, what, profiles)
        migs = _mig_devices(h, what, instances, parent_uuid=uuid_, parent_minor=minor_number, parent_index=index)
    fabric, broken = _fabric(h, what)
    gpu = Gpu(
        index=index,
        minor=minor_number,
        uuid=uuid_,
        product_name=_text(call(f"reading the name of {what}", pynvml.nvmlDeviceGetName, h)),
        brand=_BRANDS.get(brand, "Unknown") if brand is not None else "Unknown",
        architecture=_ARCHITECTURES.get(arch, "Unknown") if arch is not None else "Unknown",
        cuda_compute_capability=f"{major}.{minor_cc}",
        memory_bytes=int(memory.total),
        pci_bus_id=bus_id,
        pci_device_id=int(pci.pciDeviceId),
        pcie_root=topology.pcie_root(bus_id) if topology is not None else fallback_pcie_root(bus_id),
        numa_node=_numa_node(h, what, bus_id, topology),
        compute_mode=ComputeMode(mode) if mode is not None else ComputeMode.DEFAULT,
        mig_capable=mig_mode is not None,
        mig_enabled=mig_enabled,
        mig_pending=bool(mig_mode and mig_mode[1] == pynvml.NVML_DEVICE_MIG_ENABLE),
        mig_profiles=profiles,
        gpu_instances=instances,
        nvlink_peers=_nvlink_peers(h, what),
        fabric=fabric,
        fabric_fault=broken,
        mps_server=_mps_server(h, what),
    )
    return gpu, migs


MPS_SERVER = "nvidia-cuda-mps-server"


def _mps_server(h: Any, what: str) -> bool:
    """Whether an MPS server is among the GPU's compute processes (it holds a context on each GPU it serves)."""
    processes = _optional(f"listing the compute processes of {what}", pynvml.nvmlDeviceGetComputeRunningProcesses, h)
    for p in processes or ():
        try:
            name = _text(call(f"reading the name of process {p.pid}", pynvml.nvmlSystemGetProcessName, p.pid))
        except (NotFound, NotSupported):
            continue  # exited meanwhile, or an older driver
        if name.rsplit("/", 1)[-1] == MPS_SERVER:
            return True
    return False


def _numa_node(h: Any, what: str, bus_id: str, topology: PciTopology | None) -> int | None:
    node = _optional(f"reading the NUMA node of {what}", pynvml.nvmlDeviceGetNumaNodeId, h)
    if (node is None or node < 0) and topology is not None:
        return topology.numa_node(bus_id)
    return node if node is not None and node >= 0 else None


def _mig_profiles(h: Any, what: str, total_bytes: int) -> tuple[MigProfile, ...]:
    """Every GPU-instance profile the GPU offers, enum by enum, with its possible placements."""
    profiles = []
    version = 2
    for enum in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        doing = f"reading MIG profile {enum} of {what}"
        try:
            info = call(doing, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, enum, version)
        except FunctionMissing:
            if version == 1:
                raise
            version = 1  # drivers before R470 only have the v1 struct: no name, derive it
            try:
                info = call(doing, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, h, enum, version)
            except (NotSupported, InvalidArgument):
                continue
        except (NotSupported, InvalidArgument):
            continue
        placements = _placements(h, what, int(info.id))
        memory_slices = placements[0].size if placements else _memory_slices(info.memorySizeMB, total_bytes)
        name = (
            _text(info.name).removeprefix("MIG ")
            if version == 2
            else derive_profile_name(info.sliceCount, info.memorySizeMB, total_bytes, _SUFFIXES.get(enum, ""))
        )
        profiles.append(
            MigProfile(
                name=name,
                profile_enum=enum,
                gi_profile_id=int(info.id),
                compute_slices=int(info.sliceCount),
                memory_slices=memory_slices,
                max_instances=int(info.instanceCount),
                memory_mib=int(info.memorySizeMB),
                multiprocessors=int(info.multiprocessorCount),
                copy_engines=int(info.copyEngineCount),
                decoders=int(info.decoderCount),
                encoders=int(info.encoderCount),
                jpeg_engines=int(info.jpegCount),
                ofa_engines=int(info.ofaCount),
                placements=placements,
            )
        )
    return tuple(profiles)


def _eighths(memory_mib: int, total_bytes: int) -> int:
    """The profile's memory in eighths (memory slices) of the GPU's, rounded up."""
    return math.ceil(memory_mib * 2**20 / total_bytes * MEMORY_SLICES)


def _memory_slices(memory_mib: int, total_bytes: int) -> int:
    return max(1, _eighths(memory_mib, total_bytes))


def derive_profile_name(compute_slices: int, memory_mib: int, total_bytes: int, suffix: str = "") -> str:
    """NVIDIA's naming rule: memory as eighths of the GPU, rounded up, scaled to the GPU's size in GiB."""
    gb = round(_eighths(memory_mib, total_bytes) / MEMORY_SLICES * math.ceil(total_bytes / 2**30))
    return f"{compute_slices}g.{gb}gb{suffix}"


def _placements(h: Any, what: str, profile_id: int) -> tuple[MigPlacement, ...]:
    doing = f"reading the placements of MIG profile id {profile_id} on {what}"
    count = c_uint(0)
    if _optional(doing, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, None, byref(count)) is None:
        return ()
    buffer = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    call(doing, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, profile_id, buffer, byref(count))
    return tuple(sorted(MigPlacement(int(p.start), int(p.size)) for p in buffer[: count.value]))


def _gpu_instances(h: Any, what: str, profiles: tuple[MigProfile, ...]) -> tuple[GpuInstance, ...]:
    found = []
    for profile in profiles:
        buffer = (pynvml.c_nvmlGpuInstance_t * max(profile.max_instances, 1))()
        count = c_uint(0)
        doing = f"listing {profile.name} GPU instances on {what}"
        call(doing, pynvml.nvmlDeviceGetGpuInstances, h, profile.gi_profile_id, buffer, byref(count))
        for gi in buffer[: count.value]:
            info = call(doing, pynvml.nvmlGpuInstanceGetInfo, gi)
            placement = MigPlacement(int(info.placement.start), int(info.placement.size))
            found.append(GpuInstance(int(info.id), int(info.profileId), profile.name, placement))
    return tuple(sorted(found, key=lambda g: g.placement))


def _mig_devices(
    h: Any, what: str, instances: tuple[GpuInstance, ...], *, parent_uuid: str, parent_minor: int, parent_index: int
) -> list[MigDevice]:
    """MIG device handles; their indices are sparse, so absent ones are skipped, other errors raised."""
    by_gi = {gi.gpu_instance_id: gi for gi in instances}
    devices = []
    slots = call(f"counting MIG devices of {what}", pynvml.nvmlDeviceGetMaxMigDeviceCount, h)
    for i in range(slots):
        doing = f"reading MIG device {i} of {what}"
        try:
            mh = call(doing, pynvml.nvmlDeviceGetMigDeviceHandleByIndex, h, i)
        except (NotFound, InvalidArgument):
            continue
        flag = call(doing, pynvml.nvmlDeviceIsMigDeviceHandle, mh)
        if not getattr(flag, "value", flag):  # a c_uint: c_uint(1) == 1 is False
            continue
        gi_id = int(call(doing, pynvml.nvmlDeviceGetGpuInstanceId, mh))
        gi = by_gi.get(gi_id)
        if gi is None:
            raise NotFound(f"{doing}: its GPU instance {gi_id} is not among the instances NVML listed")
        attrs = call(doing, pynvml.nvmlDeviceGetAttributes, mh)
        devices.append(
            MigDevice(
                uuid=_text(call(doing, pynvml.nvmlDeviceGetUUID, mh)),
                parent_uuid=parent_uuid,
                parent_minor=parent_minor,
                parent_index=parent_index,
                profile=gi.profile,
                gi_profile_id=gi.gi_profile_id,
                placement=gi.placement,
                gpu_instance_id=gi_id,
                compute_instance_id=int(call(doing, pynvml.nvmlDeviceGetComputeInstanceId, mh)),
                memory_bytes=int(attrs.memorySizeMB) * 2**20,
                multiprocessors=int(attrs.multiprocessorCount),
                copy_engines=int(attrs.sharedCopyEngineCount),
                decoders=int(attrs.sharedDecoderCount),
                encoders=int(attrs.sharedEncoderCount),
                jpeg_engines=int(attrs.sharedJpegCount),
                ofa_engines=int(attrs.sharedOfaCount),
            )
        )
    return sorted(devices, key=lambda m: m.placement)


def _nvlink_peers(h: Any, what: str) -> tuple[str, ...]:
    """PCI bus ids at the far end of active links (GPUs or NVSwitches); links stop at NotSupported."""
    peers: list[str] = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        doing = f"reading NVLink {link} of {what}"
        try:
            state = call(doing, pynvml.nvmlDeviceGetNvLinkState, h, link)
            if state != pynvml.NVML_FEATURE_ENABLED:
                continue
            remote = call(doing, pynvml.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
        except (NotSupported, InvalidArgument):
            break
        peers.append(normalize_bus_id(remote.busId))
    return tuple(dict.fromkeys(peers))


def _fabric(h: Any, what: str) -> tuple[FabricInfo | None, str | None]:
    """The NVLink fabric clique, only when the fabric manager finished registering this GPU, and what is wrong
    with the fabric (agent.devices.fabric.fabric_fault; None without one)."""
    info = pynvml.c_nvmlGpuFabricInfoV_t()
    doing = f"reading the fabric info of {what}"
    try:
        call(doing, pynvml.nvmlDeviceGetGpuFabricInfoV, h, byref(info))
    except FunctionMissing:
        info = pynvml.c_nvmlGpuFabricInfo_t()  # drivers before R550 only have the v1 call
        if _optional(doing, pynvml.nvmlDeviceGetGpuFabricInfo, h, byref(info)) is None:
            return None, None
    except NotSupported:
        return None, None
    mask = int(getattr(info, "healthMask", 0))  # the v1 struct of drivers before R550 has none
    degraded_bw = (mask >> pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW) & 0b11
    degraded = degraded_bw == pynvml.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
    fault = fabric_fault(int(info.state), int(info.status), degraded)
    cluster = bytes(info.clusterUuid)
    if info.state != pynvml.NVML_GPU_FABRIC_STATE_COMPLETED or info.status != 0 or not any(cluster):
        return None, fault
    return FabricInfo(str(uuid.UUID(bytes=cluster)), int(info.cliqueId), degraded=degraded), fault
