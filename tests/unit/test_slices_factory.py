"""Inventories for slice tests, built directly from agent.devices.model and the stored MIG profile table."""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

from agent.devices.model import Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from agent.devices.topology import assign_nvlink_domains

PROFILES_JSON = pathlib.Path(__file__).resolve().parents[2] / "fakes" / "nvml" / "data" / "mig-profiles.json"
H100_MEMORY = 80 * 1024**3


@functools.cache
def mig_profiles(product: str = "H100-80GB") -> tuple[MigProfile, ...]:
    table = json.loads(PROFILES_JSON.read_text())["products"][product]["profiles"]
    return tuple(
        MigProfile(
            name=p["name"],
            profile_enum=p["profileId"],
            gi_profile_id=p["infoId"],
            compute_slices=p["computeSlices"],
            memory_slices=p["memorySlices"],
            max_instances=p["maxInstances"],
            memory_mib=p["memoryMiB"] or 0,
            multiprocessors=p["multiprocessors"],
            copy_engines=p["copyEngines"],
            decoders=p["decoders"],
            encoders=p["encoders"],
            jpeg_engines=p["jpeg"],
            ofa_engines=p["ofa"],
            placements=tuple(MigPlacement(pl["start"], pl["size"]) for pl in p["placements"]),
        )
        for p in table
    )


def h100(minor: int, **changes: object) -> Gpu:
    bus = f"0000:{0x18 + 0x10 * minor:02x}:00.0"
    gpu = Gpu(
        index=minor,
        minor=minor,
        uuid=f"GPU-{minor:08d}-aaaa-bbbb-cccc-000000000000",
        product_name="NVIDIA H100 80GB HBM3",
        brand="Nvidia",
        architecture="Hopper",
        cuda_compute_capability="9.0",
        memory_bytes=H100_MEMORY,
        pci_bus_id=bus,
        pci_device_id=0x233010DE,
        pcie_root=f"pci0000:{0x17 + 0x10 * minor:02x}",
        numa_node=minor // 4,
        mig_capable=True,
        mig_profiles=mig_profiles(),
    )
    return dataclasses.replace(gpu, **changes)  # type: ignore[arg-type]


def nvswitch_inventory(gpus: list[Gpu], migs: tuple[MigDevice, ...] = (), driver: str = "550.54.15") -> Inventory:
    """All GPUs on one NVSwitch fabric: every GPU is an NVLink peer of every other."""
    buses = [g.pci_bus_id for g in gpus]
    linked = [dataclasses.replace(g, nvlink_peers=tuple(b for b in buses if b != g.pci_bus_id)) for g in gpus]
    stamped, domains = assign_nvlink_domains(linked)
    return Inventory(
        driver_version=driver, cuda_driver_version="12.4", gpus=stamped, mig_devices=migs, nvlink_domains=domains
    )


def dgx_h100(**changes: object) -> Inventory:
    return nvswitch_inventory([h100(i, **changes) for i in range(8)])


def mig_device(gpu: Gpu, profile_name: str, start: int, gi_id: int = 1) -> MigDevice:
    profile = gpu.profile(profile_name)
    assert profile is not None
    placement = next(p for p in profile.placements if p.start == start)
    return MigDevice(
        uuid=f"MIG-{gpu.minor:04d}{gi_id:04d}-0000-0000-0000-000000000000",
        parent_uuid=gpu.uuid,
        parent_minor=gpu.minor,
        parent_index=gpu.index,
        profile=profile.name,
        gi_profile_id=profile.gi_profile_id,
        placement=placement,
        gpu_instance_id=gi_id,
        compute_instance_id=0,
        memory_bytes=profile.memory_bytes,
        multiprocessors=profile.multiprocessors,
        copy_engines=profile.copy_engines,
        decoders=profile.decoders,
        encoders=profile.encoders,
        jpeg_engines=profile.jpeg_engines,
        ofa_engines=profile.ofa_engines,
    )
