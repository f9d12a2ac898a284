"""`python -m fakes.nvml`: act on the fake GPUs of a state file (FAKE_NVML_STATE) from outside the agent.

    python -m fakes.nvml show  --state FILE [--machine M]   the GPUs as nvidia-smi prints them
    python -m fakes.nvml xid   --state FILE --gpu N --xid X  an Xid for the agent's NVML event wait
    python -m fakes.nvml lose  --state FILE --gpu N          the GPU falls off the bus (Xid 79 first)
    python -m fakes.nvml reset --state FILE --gpu N          `nvidia-smi -r`: instances go, MIG mode stays
    python -m fakes.nvml driver-root DIR [--layout L] [--version V]
                                                             fake nvidia-smi, nvidia-cuda-mps-control in DIR/usr/bin,
                                                             and a driver install's libraries, binaries, firmware

`--machine` is needed only to create a state that does not exist yet; otherwise the file names its machine.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
from collections.abc import Sequence

from fakes.nvml import persist
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.control import FakeNvml
from fakes.nvml.driver_files import LAYOUTS, VERSION
from fakes.nvml.machines import get_machine
from fakes.nvml.show import render
from fakes.nvml.state import GpuBusy


def open_state(path: str, machine: str | None) -> FakeNvml:
    """The fake behind a state file (not installed into pynvml: this process only steers it)."""
    data = persist.StateFile(path).read()
    if data is None and machine is None:
        raise persist.StateFileError(f"no fake NVML state at {path}; pass --machine to create one")
    name = machine if machine is not None else str(data["machine"] if data else "")
    return FakeNvml(get_machine(name), path)


def _gpu_index(fake: FakeNvml, index: int) -> int:
    if not 0 <= index < len(fake.gpus):
        raise ValueError(f"{fake.machine.name} has GPUs 0..{len(fake.gpus) - 1}, not {index}")
    return index


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakes.nvml", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, helptext in [
        ("show", "print the GPUs"),
        ("xid", "deliver an Xid"),
        ("lose", "lose a GPU"),
        ("reset", "reset a GPU"),
    ]:
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--state", required=True, help="the fake NVML state file (FAKE_NVML_STATE)")
        p.add_argument("--machine", help="machine profile, to create a state that does not exist yet")
        if name != "show":
            p.add_argument("--gpu", type=int, required=True, help="NVML index of the GPU")
        if name == "xid":
            p.add_argument("--xid", type=int, required=True, help="the Xid number (e.g. 48, 79)")
    root = sub.add_parser("driver-root", help="write a fake NVIDIA driver install (binaries, libraries) into DIR")
    root.add_argument("dir")
    root.add_argument(
        "--layout",
        choices=sorted(LAYOUTS),
        default="host",
        help="host: usr/lib/<multiarch>; driver-folder: usr/local/nvidia/{lib64,bin}",
    )
    root.add_argument(
        "--version", default=VERSION, help=f"driver version of the files (the fake NVML reports {VERSION})"
    )
    args = parser.parse_args(argv)
    if args.command == "driver-root":
        print(install_driver_root(pathlib.Path(args.dir), version=args.version, layout=args.layout))
        return 0
    if args.command == "xid" and args.xid <= 0:
        parser.error(f"--xid is a positive number, not {args.xid}")
    try:
        fake = open_state(args.state, args.machine)
        if args.command == "show":
            sys.stdout.write(render(fake.machine, fake.gpus))
        elif args.command == "xid":
            fake.inject_xid(_gpu_index(fake, args.gpu), args.xid)
            print(f"Xid {args.xid} queued for GPU {args.gpu}")
        elif args.command == "lose":
            fake.lose_gpu(_gpu_index(fake, args.gpu))
            print(f"GPU {args.gpu} has fallen off the bus")
        else:
            fake.reset_gpu(_gpu_index(fake, args.gpu))
            print(f"GPU {args.gpu} was reset")
    except (ValueError, GpuBusy) as exc:  # StateFileError is a ValueError
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
