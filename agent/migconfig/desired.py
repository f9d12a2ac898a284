"""Which layout a named config asks of each GPU of this node. Pure: no I/O.

mig-parted's rules: an entry covers the GPUs that match both its `device-filter` and its `devices`; entries
are applied in order, so the last one that covers a GPU decides it; a GPU no entry covers is left as it is.
Under `devices: all` a GPU that cannot do MIG is skipped; naming it by index is an error. Profile names are
resolved on each GPU (`1g.10gb` is a different profile on an A100-40GB and on an H100).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent.devices.model import Gpu, Inventory
from agent.migconfig.spec import MigConfigs


class ConfigRefused(Exception):
    """The label names a config that cannot be applied on this node; the message is one sentence for the
    node's Event."""


@dataclass(frozen=True)
class WantedLayout:
    """What one GPU should look like: MIG mode, and how many instances of each profile (by name)."""

    mig_enabled: bool
    devices: tuple[tuple[str, int], ...] = ()  # (profile name, count > 0), sorted
    mode_only: bool = False  # dynamic MIG: instances belong to claims, only the mode is the config's

    def describe(self) -> str:
        if not self.mig_enabled:
            return "MIG disabled"
        if not self.devices:
            return "MIG enabled, no instances"
        return ", ".join(f"{n}x {p}" for p, n in self.devices)


def wanted_layouts(
    configs: MigConfigs, name: str, inventory: Inventory, *, partitionable: bool = False
) -> dict[int, WantedLayout]:
    """The layout config `name` asks of each GPU it covers, by GPU minor.

    With `partitionable` (dynamic MIG) the config decides MIG mode only: MIG devices are made per claim at
    prepare, so a config that lists static instances for a GPU is refused, and the instances claims made
    stay while MIG stays on.

    Raises:
        ConfigRefused: unknown config name, a profile a GPU does not have, a MIG-incapable GPU named by
            index, or static instances with dynamic MIG.
    """
    specs = configs.get(name)
    if specs is None:
        known = configs.names()
        shown = ", ".join(known[:8]) + (", ..." if len(known) > 8 else "")
        raise ConfigRefused(f"unknown MIG config {name!r}: the config file has {len(known)} configs ({shown})")
    out: dict[int, WantedLayout] = {}
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        covering = [s for s in specs if s.selects(gpu.index, gpu.pci_device_id)]
        if not covering:
            continue
        spec = covering[-1]
        if not gpu.mig_capable:
            if spec.devices is None:
                continue
            raise ConfigRefused(f"MIG config {name!r} names GPU {gpu.index} ({gpu.product_name}), which cannot do MIG")
        for profile, _ in spec.mig_devices:
            _require_profile(gpu, profile, name)
        if partitionable and spec.mig_devices:
            raise ConfigRefused(
                f"MIG config {name!r} lists MIG devices for GPU {gpu.index}, but with --partitionable-devices "
                "MIG devices are created per claim: use a config that only enables MIG (e.g. all-enabled)"
            )
        out[gpu.minor] = WantedLayout(spec.mig_enabled, spec.mig_devices, mode_only=partitionable)
    return out


def _require_profile(gpu: Gpu, profile: str, config: str) -> None:
    if gpu.profile(profile) is None:
        have = ", ".join(p.name for p in gpu.mig_profiles)
        raise ConfigRefused(
            f"MIG config {config!r} asks for profile {profile} on GPU {gpu.index} ({gpu.product_name}), "
            f"which has only {have}"
        )
