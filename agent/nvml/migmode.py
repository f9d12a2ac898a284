"""A GPU's MIG mode through NVML: read it, switch it, and see whether processes still use the GPU.

nvmlDeviceSetMigMode returns an activation status rather than failing when the switch waits: Ampere keeps
the new mode pending until a GPU reset (RESET_REQUIRED), Hopper and later switch at once unless processes
use the GPU (IN_USE). GPUs are named by uuid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pynvml

from agent.nvml.errors import call
from agent.nvml.migctl import MigControl


@dataclass(frozen=True)
class ModeSwitch:
    """What nvmlDeviceSetMigMode said: `activated` when the mode is current now, else NVML's reason."""

    activated: bool
    reason: str = ""


_REASONS = {
    pynvml.NVML_ERROR_RESET_REQUIRED: "the GPU needs a reset",
    pynvml.NVML_ERROR_IN_USE: "processes use the GPU",
}


class MigMode:
    """MIG mode control on the GPUs of an initialised NVML session."""

    def get(self, gpu_uuid: str) -> tuple[bool, bool]:
        """(current, pending) MIG mode."""
        current, pending = call(
            f"reading the MIG mode of GPU {gpu_uuid}", pynvml.nvmlDeviceGetMigMode, self._gpu(gpu_uuid)
        )
        return current == pynvml.NVML_DEVICE_MIG_ENABLE, pending == pynvml.NVML_DEVICE_MIG_ENABLE

    def set(self, gpu_uuid: str, enabled: bool) -> ModeSwitch:
        """Ask for MIG mode on or off. Raises NvmlError when NVML refuses (e.g. InUse while instances exist)."""
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        status = int(
            call(
                f"setting MIG mode {'on' if enabled else 'off'} on GPU {gpu_uuid}",
                pynvml.nvmlDeviceSetMigMode,
                self._gpu(gpu_uuid),
                mode,
            )
        )
        if status == pynvml.NVML_SUCCESS:
            return ModeSwitch(True)
        return ModeSwitch(False, _REASONS.get(status, f"NVML activation status {status}"))

    def processes(self, gpu_uuid: str) -> int:
        """How many compute processes run on the GPU (on any of its MIG devices too)."""
        procs = call(
            f"listing the processes on GPU {gpu_uuid}", pynvml.nvmlDeviceGetComputeRunningProcesses, self._gpu(gpu_uuid)
        )
        return len(procs)

    @staticmethod
    def _gpu(gpu_uuid: str) -> Any:
        return call(f"finding GPU {gpu_uuid}", pynvml.nvmlDeviceGetHandleByUUID, gpu_uuid)


class MigReconfiguration(MigControl):
    """Everything applying a MIG layout needs (agent.migconfig.applying.MigSteps): instances and mode."""

    def __init__(self) -> None:
        self._mode = MigMode()

    def set_mig_mode(self, parent: str, enabled: bool) -> tuple[bool, str]:
        switch = self._mode.set(parent, enabled)
        return switch.activated, switch.reason

    def mig_mode(self, parent: str) -> tuple[bool, bool]:
        return self._mode.get(parent)

    def processes(self, parent: str) -> int:
        return self._mode.processes(parent)
