"""The driver's files for the CDI specs, found once when the agent starts, and said once in its log."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.driver.discovery import DEFAULT_HOOK_PATHS, discover, find_hook
from agent.driver.edits import driver_edits
from agent.driver.files import DriverFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriverSetup:
    driver_root: Path  # as the agent sees it
    host_driver_root: str  # the same root as the container runtime on the host sees it
    files: DriverFiles
    hook: str | None  # host path of nvidia-cdi-hook; None: not found, specs carry no hooks
    hook_looked_at: tuple[str, ...] = ()
    edits: dict[str, Any] = field(default_factory=dict, compare=False)  # added to every claim's spec


def set_up(driver_root: Path, host_driver_root: str, version: str, hook_path: str | None) -> DriverSetup:
    """Discover the files of driver `version` and build the edits every spec shares. Raises
    agent.driver.discovery.DriverVersionMismatch for a root of another driver."""
    files = discover(driver_root, version)
    hook = find_hook(driver_root, host_driver_root, hook_path)
    return DriverSetup(
        driver_root=Path(driver_root),
        host_driver_root=host_driver_root,
        files=files,
        hook=hook,
        hook_looked_at=(hook_path,) if hook_path else DEFAULT_HOOK_PATHS,
        edits=driver_edits(files, host_driver_root, hook),
    )


def log_setup(setup: DriverSetup) -> None:
    """One record of what the specs will carry, one warning naming what is missing, one for world-writable
    files (agent.node also makes a Node Event and a metric of them), one for files left out, one for a
    missing hook."""
    files = setup.files
    log.info(
        "driver %s files under %s (host path %s): %d libraries, %d binaries, %d firmware files, %d IPC sockets",
        files.version,
        setup.driver_root,
        setup.host_driver_root,
        len(files.libraries),
        len(files.binaries),
        len(files.firmware),
        len(files.sockets),
    )
    if files.missing:
        log.warning(
            "driver files not found under %s, so containers go without them: %s",
            setup.driver_root,
            ", ".join(files.missing),
        )
    if files.world_writable:
        log.warning(
            "driver files under %s are writable by every user on the host, and every container mounts them: %s; "
            "make them writable by root alone",
            setup.driver_root,
            ", ".join(files.world_writable),
        )
    if files.left_out:
        log.warning(
            "driver files left out of the CDI specs, their names holding '::', ',' or a line break, which "
            "nvidia-cdi-hook arguments cannot carry: %s",
            ", ".join(map(repr, files.left_out)),
        )
    if setup.hook is None:
        log.warning(
            "nvidia-cdi-hook not found (looked at %s): CDI specs mount the driver's files but run no hooks, so a "
            "container finds libcuda.so.1 only if it runs ldconfig itself; set --nvidia-cdi-hook-path",
            ", ".join(setup.hook_looked_at),
        )
    else:
        log.info("CDI specs run nvidia-cdi-hook from %s", setup.hook)
