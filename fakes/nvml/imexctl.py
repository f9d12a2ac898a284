"""Fake `nvidia-imex-ctl`: asks the local IMEX daemon (the fake nvidia-imex) how it is.

    nvidia-imex-ctl -c <imexd.cfg> -q     prints READY (what NVIDIA's compute-domain daemon checks, byte for byte:
                                          "READY\\n") or UNAVAILABLE; exit 0 either way
    nvidia-imex-ctl -c <imexd.cfg> -N     the nodes the daemon serves, one a line, with this node's state

No daemon (no status file, or its pid gone) is an error on stderr and exit 1, as when the real tool cannot reach
the daemon's command port. The daemon is not ready until its start-up delay passed and while any GPU of this
machine's fake state (FAKE_NVML_STATE) has a fabric that is not registered (state not COMPLETED, or an error
status): a broken fabric takes the node's IMEX daemon down with it.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import pynvml as N

from fakes.nvml import persist
from fakes.nvml.imex import read_config, status_path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fabric_problem() -> str:
    """Why this node's fabric cannot carry IMEX traffic ("" when it can), from the fake GPUs' shared state."""
    state = os.environ.get(persist.ENV)
    if not state:
        return ""
    data = persist.StateFile(state).read() or {}
    for index, gpu in enumerate(data.get("gpus") or []):
        fabric = gpu.get("fabric")  # absent: the machine profile's, registered
        if fabric is None:
            continue
        if int(fabric["state"]) != N.NVML_GPU_FABRIC_STATE_COMPLETED or int(fabric["status"]) != N.NVML_SUCCESS:
            return f"GPU {index}: fabric state {fabric['state']}, status {fabric['status']}"
    return ""


def _status(config: pathlib.Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(status_path(config).read_text())
    except (OSError, ValueError):
        return None
    return data if _alive(int(data.get("pid", 0))) else None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "-c" or args[2] not in ("-q", "-N"):
        print("usage: nvidia-imex-ctl -c <config file> -q|-N", file=sys.stderr)
        return 2
    config = pathlib.Path(args[1])
    try:
        settings = read_config(config)
    except (OSError, ValueError) as exc:
        print(f"nvidia-imex-ctl: {exc}", file=sys.stderr)
        return 1
    status = _status(config)
    if status is None:
        port = settings.get("IMEX_CMD_PORT", "50005")
        print(
            f"nvidia-imex-ctl: cannot connect to the IMEX daemon at "
            f"{settings.get('IMEX_CMD_BIND_INTERFACE_IP') or '127.0.0.1'}:{port}",
            file=sys.stderr,
        )
        return 1
    ready = time.time() >= float(status.get("readyAt", 0)) and not fabric_problem()
    if args[2] == "-q":
        print("READY" if ready else "UNAVAILABLE")
        return 0
    me = settings.get("IMEX_CMD_BIND_INTERFACE_IP", "")
    print("Nodes:")
    for i, node in enumerate(status.get("nodes") or []):
        state = ("READY" if ready else "UNAVAILABLE") if node == me else "UNKNOWN"
        print(f"Node #{i} - {node} - {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
