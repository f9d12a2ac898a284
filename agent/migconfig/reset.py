"""Resetting a GPU so a pending MIG mode takes effect: `nvidia-smi -r -i <bus id>`, as mig-parted does.

NVML has no reset call the agent may use; nvidia-smi resets one GPU without unloading the driver. The binary
is looked up under the driver root as every NVIDIA binary the agent runs (agent.sharing.commands), and run
without a shell.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from agent.sharing.commands import DriverRoot, NotRun

RESET_TIMEOUT_S = 120.0


class GpuResetFailed(Exception):
    """nvidia-smi could not be found or refused the reset."""


def reset_gpu(bus_id: str, driver_root: Path = Path("/")) -> None:
    """Reset the GPU at PCI `bus_id`. Raises GpuResetFailed with nvidia-smi's own words."""
    try:
        binary = DriverRoot(driver_root).find("nvidia-smi")
    except NotRun as exc:
        raise GpuResetFailed(f"cannot reset GPU {bus_id}: {exc}") from None
    try:
        done = subprocess.run(
            [binary, "-r", "-i", bus_id], capture_output=True, text=True, timeout=RESET_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpuResetFailed(f"resetting GPU {bus_id} with {binary} failed: {exc}") from exc
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise GpuResetFailed(f"{binary} -r -i {bus_id} exited {done.returncode}: {said[-1] if said else 'no output'}")
