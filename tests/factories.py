"""Model objects for tests that need a GPU without a fake NVML: one H100 80GB, with any field changed."""

from __future__ import annotations

import dataclasses

from agent.devices.model import Gpu

_H100 = Gpu(
    index=0,
    minor=0,
    uuid="GPU-00000000",
    product_name="NVIDIA H100 80GB HBM3",
    brand="Nvidia",
    architecture="Hopper",
    cuda_compute_capability="9.0",
    memory_bytes=80 * 2**30,
    pci_bus_id="0000:18:00.0",
    pci_device_id=0x233010DE,
)


def h100(minor: int, **changes: object) -> Gpu:
    """GPU `minor` (index = minor, its own uuid and bus id), then `changes` applied."""
    base = dataclasses.replace(
        _H100, index=minor, minor=minor, uuid=f"GPU-{minor:08d}", pci_bus_id=f"0000:{0x18 + minor:02x}:00.0"
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]
