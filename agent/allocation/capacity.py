"""The capacity summary an agent reports to the arbiter: enough to pick candidate nodes, not devices."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from agent.allocation.catalog import NodeUsage, candidates
from agent.allocation.fragmentation import MILLI
from agent.devices.model import Inventory


@dataclass(frozen=True)
class CapacitySummary:
    free_gpus_by_model: dict[str, int]  # whole free GPUs per product name
    free_gpus_by_domain: dict[str, int]  # whole free GPUs per NVLink domain
    free_mig_placements: dict[str, int]  # MIG devices (existing free or creatable) per profile
    free_gpu_milli: int  # idle milli over all non-MIG GPUs, fractions of shared GPUs included


def summarize(inv: Inventory, usage: NodeUsage) -> CapacitySummary:
    by_model: Counter[str] = Counter()
    by_domain: Counter[str] = Counter()
    mig: Counter[str] = Counter()
    idle = 0
    for c in candidates(inv, usage):
        if c.kind == "gpu":
            idle += c.free_milli
            if c.free_milli == MILLI:
                by_model[c.gpu.product_name] += 1
                by_domain[c.nvlink_domain] += 1
        elif c.mig_profile is not None:
            mig[c.mig_profile.name] += 1
    return CapacitySummary(dict(by_model), dict(by_domain), dict(mig), idle)
