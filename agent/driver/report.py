"""What the driver root provides to containers, for `gpu-dra-agent inventory` (pure: formatting only)."""

from __future__ import annotations

import textwrap
from typing import Any

from agent.driver.startup import DriverSetup


def document(setup: DriverSetup) -> dict[str, Any]:
    files = setup.files
    return {
        "version": files.version,
        "driverRoot": str(setup.driver_root),
        "hostDriverRoot": setup.host_driver_root,
        "libraries": [lib.path for lib in files.libraries],
        "binaries": [b.path for b in files.binaries],
        "firmware": [f.path for f in files.firmware],
        "ipcSockets": [s.path for s in files.sockets],
        "missing": list(files.missing),
        "nvidiaCdiHook": setup.hook,
    }


def table_lines(setup: DriverSetup) -> list[str]:
    files = setup.files
    where = str(setup.driver_root)
    if setup.host_driver_root != where:
        where += f" (host {setup.host_driver_root})"
    lines = [f"Driver files for containers under {where}:"]
    for label, found in (
        ("libraries", [lib.name for lib in files.libraries]),
        ("binaries", [b.name for b in files.binaries]),
        ("firmware", [f.name for f in files.firmware]),
        ("IPC sockets", [s.path for s in files.sockets]),
    ):
        lines += _wrapped(f"{label}:", f"{len(found)}: {', '.join(found) or '-'}")
    lines += _wrapped("missing:", f"{len(files.missing)}: {', '.join(files.missing) or '-'}")
    hook = setup.hook or "not found (" + ", ".join(setup.hook_looked_at) + "): specs carry mounts but no hooks"
    lines += _wrapped("hook:", hook)
    return lines


def _wrapped(label: str, text: str) -> list[str]:
    return textwrap.wrap(text, 110, initial_indent=f"  {label:13}", subsequent_indent=" " * 15, break_on_hyphens=False)
