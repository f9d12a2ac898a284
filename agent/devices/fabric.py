"""Whether a GPU's multi-node NVLink fabric is broken, from what NVML's nvmlDeviceGetGpuFabricInfoV reports: pure.

A GPU whose NVML reports fabric support (GB200, GH200 NVL) is broken while the fabric manager has not finished
registering it (state NOT_STARTED or IN_PROGRESS), when registration failed (state COMPLETED with an error
status), or when the fabric reports a degraded bandwidth (healthMask DEGRADED_BW). A GPU without a fabric
(NOT_SUPPORTED: PCIe H100, HGX H100 on NVSwitch) is never broken by this. The fault names the state, short
enough to be a device taint's value (agent.slices.taints.fabric_taint).
"""

from __future__ import annotations

from agent.devices.model import Inventory
from agent.devices.names import gpu_device_name

# NVML_GPU_FABRIC_STATE_* (nvml.h): part of NVML's ABI, so fixed
NOT_SUPPORTED, NOT_STARTED, IN_PROGRESS, COMPLETED = 0, 1, 2, 3
NOT_STARTED_FAULT, IN_PROGRESS_FAULT, FAILED, DEGRADED = "not-started", "in-progress", "failed", "degraded-bandwidth"


def fabric_fault(state: int, status: int, degraded: bool) -> str | None:
    """The fault of a GPU's fabric from its registration `state`, `status` (an NVML return code) and whether
    its bandwidth is degraded; None when it is whole or the GPU has none."""
    if state == NOT_STARTED:
        return NOT_STARTED_FAULT
    if state == IN_PROGRESS:
        return IN_PROGRESS_FAULT
    if state != COMPLETED:  # NOT_SUPPORTED, or a state newer than this code knows: nothing to say
        return None
    if status != 0:
        return FAILED
    return DEGRADED if degraded else None


def broken_devices(inventory: Inventory) -> dict[str, str]:
    """device name -> its GPU's fabric fault, for every GPU whose fabric is broken and the MIG devices on it."""
    out: dict[str, str] = {}
    for gpu in inventory.gpus:
        if gpu.fabric_fault:
            out[gpu_device_name(gpu.minor)] = gpu.fabric_fault
            out.update((m.name, gpu.fabric_fault) for m in inventory.mig_devices_of(gpu.minor))
    return out


def fabric_reason(fault: str) -> str:
    """Why a device with this fault is unhealthy, for the health stream and Events."""
    return f"NVLink fabric {fault}"
