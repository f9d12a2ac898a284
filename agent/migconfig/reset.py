"""Resetting a GPU so a pending MIG mode takes effect: `nvidia-smi -r -i <bus id>`, as mig-parted does.

NVML has no reset call the agent may use; nvidia-smi resets one GPU without unloading the driver. The binary
is looked up under the driver root (the host's `/` by default, as NVIDIA's driver's `nvidiaDriverRoot`),
and run without a shell.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

RESET_TIMEOUT_S = 120.0


class GpuResetFailed(Exception):
    """nvidia-smi could not be found or refused the reset."""


def nvidia_smi(driver_root: Path = Path("/")) -> str:
    """The nvidia-smi to run: under the driver root's bin directories, else on PATH."""
    for sub in ("usr/bin", "usr/local/bin", "bin"):
        candidate = driver_root / sub / "nvidia-smi"
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("nvidia-smi")
    if found is None:
        raise GpuResetFailed(f"nvidia-smi is neither under {driver_root} nor on PATH: cannot reset the GPU")
    return found


def reset_gpu(bus_id: str, driver_root: Path = Path("/")) -> None:
    """Reset the GPU at PCI `bus_id`. Raises GpuResetFailed with nvidia-smi's own words."""
    binary = nvidia_smi(driver_root)
    try:
        done = subprocess.run([binary, "-r", "-i", bus_id], capture_output=True, text=True,
                              timeout=RESET_TIMEOUT_S, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise GpuResetFailed(f"resetting GPU {bus_id} with {binary} failed: {exc}") from exc
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise GpuResetFailed(f"{binary} -r -i {bus_id} exited {done.returncode}: {said[-1] if said else 'no output'}")
