"""What `--partitionable-devices` may offer of a GPU: only what prepare can deliver.

A GPU in MIG mode runs only MIG devices; one out of it runs only as a whole GPU. Hopper and later GPUs
switch MIG mode at once when no process uses them, so prepare switches it for a claim and unprepare
switches it back (as NVIDIA's DynamicMIG does): both forms can be offered, the counters keep them exclusive.
Earlier GPUs (A100, A30) need a GPU reset, which prepare never does: they offer MIG placements only while
MIG mode is on, and the whole GPU only while it is off. Pure.
"""

from __future__ import annotations

from agent.devices.model import Gpu

# Compute capability 9 (Hopper) and later apply a MIG mode change without a reset.
_SWITCHES_AT_ONCE_FROM = 9


def switches_mig_mode_at_once(gpu: Gpu) -> bool:
    """Whether prepare may change this GPU's MIG mode (no reset needed)."""
    major, _, _ = gpu.cuda_compute_capability.partition(".")
    return gpu.mig_capable and major.isdigit() and int(major) >= _SWITCHES_AT_ONCE_FROM


def offers_placements(gpu: Gpu) -> bool:
    """MIG placements (created at prepare) can be offered: MIG mode is on, or prepare can turn it on."""
    return gpu.mig_capable and bool(gpu.mig_profiles) and (gpu.mig_enabled or switches_mig_mode_at_once(gpu))


def offers_whole_gpu(gpu: Gpu) -> bool:
    """The whole GPU can be offered: MIG mode is off, or prepare can turn it off (no GPU instance exists)."""
    return not gpu.mig_enabled or (switches_mig_mode_at_once(gpu) and not gpu.gpu_instances)
