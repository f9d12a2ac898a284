"""nvidia-smi: compute mode and compute-policy time slice of a GPU (by uuid)."""

from __future__ import annotations

import enum
from collections.abc import Callable

from agent.sharing.commands import CommandFailed, CommandRunner, checked

NVIDIA_SMI = "nvidia-smi"
# nvidia-smi exit codes after which there is nothing left to restore on the GPU.
GPU_GONE = frozenset({6, 15})  # not found, GPU is lost


class ComputeMode(enum.Enum):
    DEFAULT = "DEFAULT"
    EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"


class NvidiaSmi:
    def __init__(self, runner: CommandRunner) -> None:
        self.runner = runner

    def set_compute_mode(self, gpu_uuid: str, mode: ComputeMode) -> None:
        checked(self.runner, NVIDIA_SMI, ["-i", gpu_uuid, "-c", mode.value])

    def set_timeslice(self, gpu_uuid: str, timeslice: int) -> None:
        """0 Default, 1 Short, 2 Medium, 3 Long (NVIDIA does not document the durations)."""
        checked(self.runner, NVIDIA_SMI, ["compute-policy", "-i", gpu_uuid, f"--set-timeslice={timeslice}"])

    def restore(self, gpu_uuid: str) -> None:
        """Back to DEFAULT compute mode; a GPU that is gone needs nothing."""
        self._unless_gone(lambda: self.set_compute_mode(gpu_uuid, ComputeMode.DEFAULT))

    def restore_timeslice(self, gpu_uuid: str) -> None:
        """Back to the default time slice; a GPU that is gone needs nothing."""
        self._unless_gone(lambda: self.set_timeslice(gpu_uuid, 0))

    @staticmethod
    def _unless_gone(change: Callable[[], None]) -> None:
        try:
            change()
        except CommandFailed as exc:
            if exc.returncode not in GPU_GONE:
                raise
