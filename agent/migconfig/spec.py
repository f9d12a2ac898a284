"""mig-parted `version: v1` config files: parsed and checked as mig-parted checks them. Pure: no I/O.

    version: v1
    mig-configs:
      all-1g.10gb:
        - device-filter: ["0x233010DE"]   # optional: PCI device ids (device<<16|vendor[:subsystem]), str or list
          devices: all                    # or a list of GPU indexes
          mig-enabled: true
          mig-devices: {"1g.10gb": 7}     # required when enabled; {} = enabled with no instances

Every problem is reported as one sentence naming the config and the entry (InvalidMigConfig).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

# libyaml's loader when PyYAML has it: the operator's default file takes 10x longer in pure Python.
_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_PCI_ID = re.compile(r"^0x[0-9a-fA-F]{8}(:0x[0-9a-fA-F]{8})?$")
_ENTRY_KEYS = {"device-filter", "devices", "mig-enabled", "mig-devices"}


class InvalidMigConfig(ValueError):
    """A MIG config file that mig-parted would refuse too."""


@dataclass(frozen=True)
class DeviceFilter:
    """One `device-filter` id: device<<16|vendor, and the subsystem id when given (`0x233010DE:0x16C110DE`)."""

    device_id: int
    subsystem_id: int | None = None

    def matches(self, pci_device_id: int, pci_subsystem_id: int | None = None) -> bool:
        if self.device_id != pci_device_id:
            return False
        return self.subsystem_id is None or self.subsystem_id == pci_subsystem_id


@dataclass(frozen=True)
class DeviceSpec:
    """One entry of a config: which GPUs it covers and the layout they get."""

    device_filter: tuple[DeviceFilter, ...]  # empty: any GPU
    devices: tuple[int, ...] | None  # None: `all`
    mig_enabled: bool
    mig_devices: tuple[tuple[str, int], ...]  # (profile name, count) with count > 0, sorted by name

    def selects(self, index: int, pci_device_id: int) -> bool:
        """Whether this entry covers the GPU at NVML index `index` with this PCI device id."""
        if self.devices is not None and index not in self.devices:
            return False
        return not self.device_filter or any(f.matches(pci_device_id) for f in self.device_filter)


@dataclass(frozen=True)
class MigConfigs:
    """Every named config of one file."""

    configs: Mapping[str, tuple[DeviceSpec, ...]]

    def names(self) -> list[str]:
        return sorted(self.configs)

    def get(self, name: str) -> tuple[DeviceSpec, ...] | None:
        return self.configs.get(name)


def parse_mig_configs(text: str, source: str = "the MIG config") -> MigConfigs:
    """Parse and check a mig-parted v1 file; `source` names it in errors.

    Raises:
        InvalidMigConfig: not YAML, not version v1, unknown keys, or an entry mig-parted would refuse.
    """
    try:
        doc = yaml.load(text, Loader=_LOADER)  # noqa: S506 - a safe loader (C or Python)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise InvalidMigConfig(f"{source} is not valid YAML{at}") from exc
    if not isinstance(doc, dict):
        raise InvalidMigConfig(f"{source} must be a mapping with `version: v1` and `mig-configs`")
    unknown = sorted(set(doc) - {"version", "mig-configs"})
    if unknown:
        raise InvalidMigConfig(f"{source} has unknown top-level keys {unknown} (only version and mig-configs)")
    if doc.get("version") != "v1":
        raise InvalidMigConfig(f"{source} must say `version: v1`, not {doc.get('version')!r}")
    configs = doc.get("mig-configs")
    if not isinstance(configs, dict) or not configs:
        raise InvalidMigConfig(f"{source} needs `mig-configs` with at least one named config")
    parsed: dict[str, tuple[DeviceSpec, ...]] = {}
    for name, entries in configs.items():
        if not isinstance(name, str) or not name:
            raise InvalidMigConfig(f"{source}: config names must be non-empty strings, not {name!r}")
        if not isinstance(entries, list) or not entries:
            raise InvalidMigConfig(f"{source}: config {name!r} must be a non-empty list of device entries")
        parsed[name] = tuple(_entry(e, f"{source}: config {name!r} entry {i}") for i, e in enumerate(entries))
    return MigConfigs(parsed)


def _entry(raw: Any, where: str) -> DeviceSpec:
    if not isinstance(raw, dict):
        raise InvalidMigConfig(f"{where} must be a mapping")
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise InvalidMigConfig(f"{where} has unknown keys {unknown} (allowed: {sorted(_ENTRY_KEYS)})")
    for key in ("devices", "mig-enabled"):
        if key not in raw:
            raise InvalidMigConfig(f"{where} is missing `{key}`")
    enabled = raw["mig-enabled"]
    if not isinstance(enabled, bool):
        raise InvalidMigConfig(f"{where}: mig-enabled must be true or false, not {enabled!r}")
    devices = _mig_devices(raw.get("mig-devices"), where)
    if enabled and "mig-devices" not in raw:
        raise InvalidMigConfig(f"{where}: mig-enabled is true, so mig-devices is required ({{}} for none)")
    if not enabled and devices:
        raise InvalidMigConfig(f"{where}: mig-enabled is false but mig-devices lists instances")
    return DeviceSpec(_filters(raw.get("device-filter"), where), _indexes(raw["devices"], where), enabled, devices)


def _filters(raw: Any, where: str) -> tuple[DeviceFilter, ...]:
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise InvalidMigConfig(f"{where}: device-filter must be a PCI id string or a non-empty list of them")
    out = []
    for item in items:
        if not isinstance(item, str) or not _PCI_ID.match(item):
            raise InvalidMigConfig(f"{where}: device-filter {item!r} is not a PCI id like 0x233010DE[:0x16C110DE]")
        device, _, subsystem = item.partition(":")
        out.append(DeviceFilter(int(device, 16), int(subsystem, 16) if subsystem else None))
    return tuple(out)


def _indexes(raw: Any, where: str) -> tuple[int, ...] | None:
    if raw == "all":
        return None
    if isinstance(raw, list) and raw and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in raw):
        return tuple(sorted(set(raw)))
    raise InvalidMigConfig(f"{where}: devices must be `all` or a non-empty list of GPU indexes, not {raw!r}")


def _mig_devices(raw: Any, where: str) -> tuple[tuple[str, int], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidMigConfig(f"{where}: mig-devices must map profile names to counts")
    out = []
    for profile, count in raw.items():
        if not isinstance(profile, str) or not profile:
            raise InvalidMigConfig(f"{where}: mig-devices key {profile!r} is not a profile name")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise InvalidMigConfig(f"{where}: mig-devices {profile!r} needs a count >= 0, not {count!r}")
        if count:
            out.append((profile, count))
    if raw and not out:
        raise InvalidMigConfig(f"{where}: mig-devices counts are all 0 (use {{}} for no instances)")
    return tuple(sorted(out))
