"""GPU products the fake can impersonate, with their MIG profiles read from data/mig-profiles.json."""

from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass
from typing import Any

_DATA = pathlib.Path(__file__).parent / "data" / "mig-profiles.json"

# NVML enum values (nvmlDeviceArchitecture_t, nvmlBrandType_t)
ARCH_AMPERE, ARCH_ADA, ARCH_HOPPER, ARCH_BLACKWELL = 7, 8, 9, 10
BRAND_NVIDIA = 14


@dataclass(frozen=True)
class Profile:
    """One GPU-instance profile of one product: `enum` is NVML_GPU_INSTANCE_PROFILE_*, `id` the driver's info.id."""

    name: str  # "1g.10gb", without the "MIG " prefix NVML puts in front
    enum: int
    id: int
    compute_slices: int
    memory_slices: int
    max_instances: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg: int
    ofa: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slices


@dataclass(frozen=True)
class Product:
    """A GPU model as NVML describes it."""

    name: str  # nvmlDeviceGetName
    pci_device_id: int  # device << 16 | vendor
    architecture: int
    compute_capability: tuple[int, int]
    memory_mib: int  # nvmlDeviceGetMemoryInfo total, in MiB
    nvlinks: int  # NVLink links the chip has (0: NotSupported from link 0)
    profiles: tuple[Profile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.profiles)

    @property
    def applies_mig_mode_at_once(self) -> bool:
        """Hopper and newer switch MIG mode without a reset when idle; Ampere keeps it pending until reset."""
        return self.architecture >= ARCH_HOPPER


# Where the table has no measured value (null), take the same profile row of a product built on the same
# die: H200 and GH200 are GH100 parts with the 132-SM H100 partitioning.
_FALLBACK = {"H200-141GB": "H100-80GB", "GH200-96GB": "H100-80GB", "GH200-144GB": "H100-80GB"}


@functools.cache
def _table() -> dict[str, dict[str, Any]]:
    products: dict[str, dict[str, Any]] = json.loads(_DATA.read_text())["products"]
    return products


def derived_memory_mib(total_mib: int, memory_slices: int) -> int:
    """Memory of a GI whose size the table does not give: its share of the total, less the ~2% the driver
    keeps per instance (as measured on H100: 81559 MiB total -> 9984 MiB per 1-slice GI), in 128 MiB units.
    The result still rounds to the profile's name under NVIDIA's naming rule (ceil(mem/total*8) = slices)."""
    return int(total_mib * memory_slices / 8 * 0.98) // 128 * 128


@functools.cache
def mig_profiles(table_key: str, total_mib: int) -> tuple[Profile, ...]:
    """The GI profiles of a product from the shared table, nulls filled as described above."""
    rows: list[dict[str, Any]] = _table()[table_key]["profiles"]
    fallback_key = _FALLBACK.get(table_key)
    fallback: dict[int, dict[str, Any]] = {}
    if fallback_key:
        fallback = {r["profileId"]: r for r in _table()[fallback_key]["profiles"]}

    def value(row: dict[str, Any], key: str) -> int:
        v = row[key]
        if v is None:
            v = fallback.get(row["profileId"], {}).get(key)
        if v is None:
            raise ValueError(f"{table_key} {row['name']}: no value for {key} and no fallback product")
        return int(v)

    out = []
    for r in rows:
        memory_slices = int(r["memorySlices"])
        memory = r["memoryMiB"]
        out.append(
            Profile(
                name=str(r["name"]),
                enum=int(r["profileId"]),
                id=int(r["infoId"]),
                compute_slices=int(r["computeSlices"]),
                memory_slices=memory_slices,
                max_instances=int(r["maxInstances"]),
                memory_mib=int(memory) if memory is not None else derived_memory_mib(total_mib, memory_slices),
                multiprocessors=value(r, "multiprocessors"),
                copy_engines=value(r, "copyEngines"),
                decoders=value(r, "decoders"),
                encoders=value(r, "encoders"),
                jpeg=value(r, "jpeg"),
                ofa=value(r, "ofa"),
                placements=tuple((int(p["start"]), int(p["size"])) for p in r["placements"]),
            )
        )
    return tuple(out)


def _mig(name: str, pci: int, arch: int, cc: tuple[int, int], mib: int, links: int, table_key: str) -> Product:
    return Product(name, pci, arch, cc, mib, links, mig_profiles(table_key, mib))


# Memory totals are what NVML reports on these parts (nvidia-smi "Total" FB memory).
A100_SXM4_40GB = _mig("NVIDIA A100-SXM4-40GB", 0x20B010DE, ARCH_AMPERE, (8, 0), 40960, 12, "A100-SXM4-40GB")
A100_PCIE_40GB = _mig("NVIDIA A100-PCIE-40GB", 0x20F110DE, ARCH_AMPERE, (8, 0), 40960, 0, "A100-SXM4-40GB")
A100_SXM4_80GB = _mig("NVIDIA A100-SXM4-80GB", 0x20B210DE, ARCH_AMPERE, (8, 0), 81920, 12, "A100-SXM4-80GB")
H100_SXM5_80GB = _mig("NVIDIA H100 80GB HBM3", 0x233010DE, ARCH_HOPPER, (9, 0), 81559, 18, "H100-80GB")
H100_NVL = _mig("NVIDIA H100 NVL", 0x232110DE, ARCH_HOPPER, (9, 0), 95830, 12, "H100-94GB-NVL")
H200_SXM5 = _mig("NVIDIA H200", 0x233510DE, ARCH_HOPPER, (9, 0), 143771, 18, "H200-141GB")
GH200_96GB = _mig("NVIDIA GH200 480GB", 0x234210DE, ARCH_HOPPER, (9, 0), 97871, 18, "GH200-96GB")
L40S = Product("NVIDIA L40S", 0x26B910DE, ARCH_ADA, (8, 9), 46068, 0)  # not MIG-capable
# GB200's MIG profiles are not in data/mig-profiles.json: the fake offers it without MIG (multi-node NVLink tests).
GB200 = Product("NVIDIA GB200", 0x294110DE, ARCH_BLACKWELL, (10, 0), 189471, 18)
