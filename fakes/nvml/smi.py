"""A fake `nvidia-smi` over the fake GPUs of FAKE_NVML_STATE: the subset the node agent runs.

    nvidia-smi -L
    nvidia-smi -i <index|uuid|bus id> -c DEFAULT|EXCLUSIVE_PROCESS|PROHIBITED|0|2|3
    nvidia-smi compute-policy -i <uuid> --set-timeslice=<0..3>      (or --set-timeslice <0..3>)

Output and exit codes follow the real tool (2 bad argument, 3 not supported, 6 not found, 9 no driver,
15 GPU lost). MIG devices take neither a compute mode nor a time slice; the real tool refuses both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import pynvml as N

from fakes.nvml import persist
from fakes.nvml.control import FakeNvml
from fakes.nvml.machines import get_machine
from fakes.nvml.show import COMPUTE_MODES
from fakes.nvml.state import FakeGpu

EXIT_INVALID, EXIT_NOT_SUPPORTED, EXIT_NOT_FOUND, EXIT_NO_DRIVER, EXIT_LOST = 2, 3, 6, 9, 15
_MODES = {"DEFAULT": 0, "0": 0, "PROHIBITED": 2, "2": 2, "EXCLUSIVE_PROCESS": 3, "3": 3}
_TIMESLICES = {"0": "Default", "1": "Short", "2": "Medium", "3": "Long"}


class SmiError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def open_gpus() -> FakeNvml:
    """The fake GPUs this process's environment names, as the real tool finds the driver."""
    path = os.environ.get(persist.ENV)
    data = persist.StateFile(path).read() if path else None
    if data is None:
        raise SmiError(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            f"(fake: {persist.ENV} names no state file)",
            EXIT_NO_DRIVER,
        )
    return FakeNvml(get_machine(str(data["machine"])), path)


def find(fake: FakeNvml, ident: str) -> tuple[FakeGpu, bool]:
    """The GPU `-i` names (index, GPU-/MIG- uuid or PCI bus id), and whether the id named a MIG device."""
    for gpu in fake.gpus:
        bus = gpu.bus_id.lower()
        if ident in (str(gpu.index), gpu.uuid) or ident.lower() in (bus, bus[4:]):
            return gpu, False
        if any(ci.uuid == ident for ci in gpu.mig_devices()):
            return gpu, True
    raise SmiError(f"No devices were found matching {ident!r}", EXIT_NOT_FOUND)


def _alive(gpu: FakeGpu) -> FakeGpu:
    if gpu.lost:
        raise SmiError(
            f"Unable to determine the device handle for GPU {gpu.bus_id}: GPU is lost. Reboot the "
            "system to recover this GPU",
            EXIT_LOST,
        )
    return gpu


def _option(args: list[str], *names: str) -> str | None:
    """The value of `-x v`, `--x v` or `--x=v`; removes it from `args`."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                value = args[i + 1]
                del args[i : i + 2]
                return value
            if arg.startswith(name + "="):
                del args[i]
                return arg.split("=", 1)[1]
    return None


def list_gpus(fake: FakeNvml) -> str:
    lines = []
    for gpu in fake.gpus:
        lines.append(f"GPU {gpu.index}: {gpu.product.name} (UUID: {gpu.uuid})")
        for ci in gpu.mig_devices() if not gpu.lost else []:
            lines.append(f"  MIG {ci.profile.name:<14} Device {ci.mig_index:>2}: (UUID: {ci.uuid})")
    return "\n".join(lines) + "\n"


def set_compute_mode(fake: FakeNvml, ident: str, mode_text: str) -> str:
    mode = _MODES.get(mode_text.upper())
    if mode is None:
        raise SmiError(
            f"Invalid compute mode {mode_text!r}: use DEFAULT, PROHIBITED or EXCLUSIVE_PROCESS", EXIT_INVALID
        )
    with fake.mutation():
        gpu, mig = find(fake, ident)
        _alive(gpu)
        if mig:
            raise SmiError(f"Setting the compute mode of MIG device {ident} is not supported", EXIT_NOT_SUPPORTED)
        gpu.compute_mode = mode
    return f"Compute mode set to {COMPUTE_MODES[mode].upper()} for GPU {gpu.bus_id}.\nAll done.\n"


def set_timeslice(fake: FakeNvml, ident: str, value: str) -> str:
    if value not in _TIMESLICES:
        raise SmiError(
            f"Invalid timeslice value {value!r}: use 0 (Default), 1 (Short), 2 (Medium) or 3 (Long)", EXIT_INVALID
        )
    with fake.mutation():
        gpu, mig = find(fake, ident)
        _alive(gpu)
        if mig:
            raise SmiError(f"Setting the timeslice of MIG device {ident} is not supported", EXIT_NOT_SUPPORTED)
        gpu.timeslice = int(value)
    return f"Set timeslice to {value} ({_TIMESLICES[value]}) for GPU {gpu.bus_id}.\nAll done.\n"


def run(argv: Sequence[str]) -> str:
    args = list(argv)
    if args == ["-L"] or args == ["--list-gpus"]:
        return list_gpus(open_gpus())
    policy = bool(args) and args[0] == "compute-policy"
    if policy:
        args.pop(0)
    ident = _option(args, "-i", "--id")
    if policy:
        value = _option(args, "--set-timeslice")
        if ident is None or value is None or args:
            raise SmiError("usage: nvidia-smi compute-policy -i <uuid> --set-timeslice=<0..3>", EXIT_INVALID)
        return set_timeslice(open_gpus(), ident, value)
    mode = _option(args, "-c", "--compute-mode")
    if ident is None or mode is None or args:
        raise SmiError(f"fake nvidia-smi: unsupported arguments {list(argv)!r}", EXIT_INVALID)
    return set_compute_mode(open_gpus(), ident, mode)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        sys.stdout.write(run(sys.argv[1:] if argv is None else argv))
    except SmiError as exc:
        print(exc, file=sys.stderr if exc.code == EXIT_INVALID else sys.stdout)
        return exc.code
    except (ValueError, N.NVMLError) as exc:  # an unusable state file
        print(f"fake nvidia-smi: {exc}", file=sys.stderr)
        return EXIT_NO_DRIVER
    return 0


if __name__ == "__main__":
    sys.exit(main())
