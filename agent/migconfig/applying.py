"""Carrying out one GPU's plan through NVML: destroy, switch MIG mode (resetting the GPU if it must), create.

Each step can be repeated after a crash: destroying finds the instance by profile and placement and treats
one already gone as destroyed, so nothing is destroyed twice; a GPU instance left without its compute
instance by a crash is seen by the next plan as not whole, destroyed and made again, so nothing leaks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from agent.devices.model import Gpu
from agent.migconfig.plan import GpuPlan

log = logging.getLogger(__name__)


class MigSteps(Protocol):
    """The NVML operations a plan needs (agent.nvml.migctl.MigControl and agent.nvml.migmode.MigMode)."""

    def destroy_at(self, parent: str, gi_profile_id: int, start: int) -> bool: ...
    def create(self, parent: str, gi_profile_id: int, start: int) -> object: ...
    def set_mig_mode(self, parent: str, enabled: bool) -> tuple[bool, str]: ...
    def mig_mode(self, parent: str) -> tuple[bool, bool]: ...
    def processes(self, parent: str) -> int: ...


class NeedsReboot(Exception):
    """The MIG mode switch waits for a GPU reset that cannot happen now (processes use the GPU): mig-manager
    reboots the node here; the agent reports `rebooting` and finishes after the reset or reboot."""


class ResetFailed(Exception):
    """The GPU reset ran but the MIG mode is still not the one asked for."""


def apply_plan(plan: GpuPlan, gpu: Gpu, steps: MigSteps, reset: Callable[[Gpu], None]) -> None:
    """Run `plan` on `gpu`. Raises NvmlError from any step, NeedsReboot, ResetFailed, or what `reset` raises;
    what was done before the failure stays done, and planning again from a fresh discovery continues."""
    parent = gpu.uuid
    for p in plan.destroy:
        steps.destroy_at(parent, p.gi_profile_id, p.start)
    if plan.mig_mode is not None:
        _switch_mode(gpu, plan.mig_mode, steps, reset)
    for p in plan.create:
        steps.create(parent, p.gi_profile_id, p.start)
    log.info("MIG layout applied", extra={"gpu": gpu.index, "plan": plan.describe()})


def _switch_mode(gpu: Gpu, enabled: bool, steps: MigSteps, reset: Callable[[Gpu], None]) -> None:
    activated, reason = steps.set_mig_mode(gpu.uuid, enabled)
    if activated:
        return
    mode = "on" if enabled else "off"
    busy = steps.processes(gpu.uuid)
    if busy:
        raise NeedsReboot(
            f"GPU {gpu.index} switches MIG mode {mode} only after a reset ({reason}), and {busy} process(es) use it"
        )
    log.info("resetting GPU %s to switch MIG mode %s (%s)", gpu.index, mode, reason)
    reset(gpu)
    current, _ = steps.mig_mode(gpu.uuid)
    if current != enabled:
        raise ResetFailed(f"GPU {gpu.index} was reset but its MIG mode is still {'on' if current else 'off'}")
