"""The fake GPUs printed as nvidia-smi users read them: `-L` lines, then per GPU its modes and the
`nvidia-smi mig -lgi` / `-lci` tables."""

from __future__ import annotations

from collections.abc import Sequence

from fakes.nvml.machines import Machine
from fakes.nvml.state import FakeGpu

COMPUTE_MODES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}
TIMESLICES = {0: "Default", 1: "Short", 2: "Medium", 3: "Long"}


def _enabled(mode: int) -> str:
    return "Enabled" if mode else "Disabled"


def render(machine: Machine, gpus: Sequence[FakeGpu]) -> str:
    lines = [f"# fake machine {machine.name}: {machine.description}"]
    for gpu in gpus:
        lines.append(f"GPU {gpu.index}: {gpu.product.name} (UUID: {gpu.uuid})")
        if gpu.lost:
            lines.append("    Unable to determine the device handle for this GPU: GPU is lost")
            continue
        mig = (
            "N/A"
            if not gpu.product.mig_capable
            else (f"{_enabled(gpu.mig_current)} (pending: {_enabled(gpu.mig_pending)})")
        )
        lines.append(
            f"    Bus Id: {gpu.bus_id}   MIG Mode: {mig}   Compute Mode: "
            f"{COMPUTE_MODES.get(gpu.compute_mode, gpu.compute_mode)}   "
            f"Time Slice: {TIMESLICES.get(gpu.timeslice, gpu.timeslice)}"
        )
        for ci in gpu.mig_devices():
            lines.append(f"  MIG {ci.profile.name:<16} Device {ci.mig_index:>2}: (UUID: {ci.uuid})")
        if gpu.gpu_instances:
            lines.append("    GPU instances:")
            lines.append("    GPU   Name            Profile  Instance   Placement")
            lines.append("                            ID       ID       Start:Size")
            for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id):
                lines.append(
                    f"    {gpu.index:>3}   MIG {gi.profile.name:<11} {gi.profile.id:>3}"
                    f"      {gi.id:>3}        {gi.start}:{gi.size}"
                )
            lines.append("    Compute instances:")
            lines.append("    GPU   GPU Instance ID   Name                 Profile ID   Instance ID   Placement")
            for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id):
                for ci in sorted(gi.compute_instances.values(), key=lambda c: c.id):
                    lines.append(
                        f"    {gpu.index:>3}   {gi.id:>15}   MIG {ci.profile.name:<16} {ci.profile.enum:>10}"
                        f"   {ci.id:>11}   {ci.start}:{ci.profile.slices}"
                    )
        for p in gpu.processes:
            lines.append(f"    Process {p.pid} {p.name or '-'} {p.used_bytes >> 20} MiB")
    return "\n".join(lines) + "\n"
