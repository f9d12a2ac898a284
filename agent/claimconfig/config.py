"""Opaque device configs (`resource.nvidia.com/v1beta1` GpuConfig, MigDeviceConfig): strict parsing and
per-device resolution.

Pure: no I/O. Decoding is strict like NVIDIA's (unknown fields, wrong types and bad values are errors), so
a typo in a claim fails its prepare instead of silently running unshared. This module only says what each
device asked for; agent.sharing applies TimeSlicing and MPS on the node.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent import quantity
from agent.quantity import Quantity

API_VERSION = "resource.nvidia.com/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_DEVICE_CONFIG = "MigDeviceConfig"


class ConfigError(ValueError):
    """An opaque config that this driver cannot accept; the message names the offending field."""


# --- Quantity -------------------------------------------------------------------------------------------


def parse_quantity(raw: object, field: str = "quantity") -> Quantity:
    """`"1Gi"`, `"500M"`, `"250m"`, `"1e3"`, `"42"` or a JSON integer; anything else is a ConfigError."""
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise ConfigError(f"{field}: want a quantity such as '1Gi', got {_shown(raw)}")
    if isinstance(raw, int) and raw.bit_length() > 4 * quantity.MAX_DIGITS:  # str() of it may itself fail
        raise ConfigError(f"{field}: an integer of {raw.bit_length()} bits is not a quantity")
    try:
        return quantity.parse(str(raw))
    except quantity.QuantityError as e:
        raise ConfigError(f"{field}: {_shown(raw)} is not a quantity ({e.reason})") from None


def _shown(raw: object, limit: int = 40) -> str:
    """`raw` for an error message, cut short: a claim may carry megabytes where a value belongs."""
    text = repr(raw) if not isinstance(raw, int) or raw.bit_length() < 1000 else f"<integer of {raw.bit_length()} bits>"
    return text if len(text) <= limit else text[:limit] + "..."


# --- Config types ---------------------------------------------------------------------------------------


class Interval(enum.Enum):
    """Time-slice length; `timeslice` is the value `nvidia-smi compute-policy --set-timeslice` takes."""

    DEFAULT = "Default"
    SHORT = "Short"
    MEDIUM = "Medium"
    LONG = "Long"

    @property
    def timeslice(self) -> int:
        return list(Interval).index(self)


@dataclass(frozen=True)
class TimeSlicing:
    """Share by time slices. `interval` is None on MIG devices, whose slice length cannot be set."""

    interval: Interval | None = Interval.DEFAULT


@dataclass(frozen=True)
class Mps:
    """Share through one MPS control daemon. Per-device limits are keyed by device index or UUID."""

    active_thread_percentage: int | None = None
    pinned_memory_limit: Quantity | None = None
    per_device_pinned_memory_limit: tuple[tuple[str, Quantity], ...] = ()


Sharing = TimeSlicing | Mps


@dataclass(frozen=True)
class GpuConfig:
    sharing: Sharing | None = None


@dataclass(frozen=True)
class MigDeviceConfig:
    sharing: Sharing | None = None


OpaqueConfig = GpuConfig | MigDeviceConfig

# Which config kind configures which device `type` (the `type` attribute published in slices).
KIND_FOR_TYPE: dict[str, str] = {"gpu": GPU_CONFIG, "mig": MIG_DEVICE_CONFIG}


# --- Strict decoding ------------------------------------------------------------------------------------


def _object(raw: object, field: str, allowed: Iterable[str]) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{field}: want an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"{field}: unknown field(s) {', '.join(map(repr, unknown))}")
    return raw


def _parse_mps(raw: object, field: str) -> Mps:
    obj = _object(
        raw,
        field,
        ("defaultActiveThreadPercentage", "defaultPinnedDeviceMemoryLimit", "defaultPerDevicePinnedMemoryLimit"),
    )
    percentage = obj.get("defaultActiveThreadPercentage")
    if percentage is not None:
        if isinstance(percentage, bool) or not isinstance(percentage, int):
            raise ConfigError(f"{field}.defaultActiveThreadPercentage: want an integer, got {percentage!r}")
        if not 1 <= percentage <= 100:
            raise ConfigError(f"{field}.defaultActiveThreadPercentage: {percentage} is outside 1..100")
    limit = obj.get("defaultPinnedDeviceMemoryLimit")
    pinned = None if limit is None else _memory_limit(limit, f"{field}.defaultPinnedDeviceMemoryLimit")
    per_device_raw = obj.get("defaultPerDevicePinnedMemoryLimit") or {}
    if not isinstance(per_device_raw, Mapping):
        raise ConfigError(f"{field}.defaultPerDevicePinnedMemoryLimit: want a map of index or UUID to quantity")
    per_device = []
    for key, value in per_device_raw.items():
        where = f"{field}.defaultPerDevicePinnedMemoryLimit[{_shown(key)}]"
        if not isinstance(key, str) or not _PER_DEVICE_KEY.fullmatch(key):
            raise ConfigError(f"{where}: key must be a device index or a GPU-/MIG- UUID")
        per_device.append((str(key), _memory_limit(value, where)))
    return Mps(percentage, pinned, tuple(per_device))


# An index (ASCII digits: str.isdigit() also takes '²', which int() refuses) or a GPU-/MIG- UUID.
_PER_DEVICE_KEY = re.compile(r"[0-9]{1,6}|(GPU|MIG)-[0-9A-Za-z/-]{1,96}")  # old MIG uuids: MIG-GPU-<uuid>/<gi>/<ci>


def _memory_limit(raw: object, field: str) -> Quantity:
    q = parse_quantity(raw, field)
    if q.value <= 0:
        raise ConfigError(f"{field}: a memory limit must be positive, got {q.text!r}")
    return q


def _parse_sharing(raw: object, field: str, kind: str) -> Sharing:
    mig = kind == MIG_DEVICE_CONFIG
    # MIG devices cannot set a time-slice interval: NVIDIA's MigDeviceSharing has no timeSlicingConfig.
    allowed = ("strategy", "mpsConfig") if mig else ("strategy", "timeSlicingConfig", "mpsConfig")
    obj = _object(raw, field, allowed)
    strategy = obj.get("strategy")
    if strategy == "TimeSlicing":
        if obj.get("mpsConfig") is not None:
            raise ConfigError(f"{field}.mpsConfig: not allowed with strategy TimeSlicing")
        if mig:
            return TimeSlicing(interval=None)
        ts = _object(obj.get("timeSlicingConfig") or {}, f"{field}.timeSlicingConfig", ("interval",))
        interval = ts.get("interval", Interval.DEFAULT.value)
        try:
            return TimeSlicing(Interval(interval))
        except ValueError:
            raise ConfigError(
                f"{field}.timeSlicingConfig.interval: {interval!r} is not one of "
                + ", ".join(i.value for i in Interval)
            ) from None
    if strategy == "MPS":
        if obj.get("timeSlicingConfig") is not None:
            raise ConfigError(f"{field}.timeSlicingConfig: not allowed with strategy MPS")
        return _parse_mps(obj.get("mpsConfig") or {}, f"{field}.mpsConfig")
    if strategy is None:
        raise ConfigError(f"{field}.strategy: required (TimeSlicing or MPS)")
    raise ConfigError(f"{field}.strategy: {strategy!r} is not TimeSlicing or MPS")


def parse_config(parameters: object) -> OpaqueConfig:
    """Decode one `opaque.parameters` object of this driver."""
    obj = _object(parameters, "parameters", ("apiVersion", "kind", "sharing"))
    if obj.get("apiVersion") != API_VERSION:
        raise ConfigError(f"apiVersion: want {API_VERSION!r}, got {obj.get('apiVersion')!r}")
    kind = obj.get("kind")
    if kind not in (GPU_CONFIG, MIG_DEVICE_CONFIG):
        raise ConfigError(f"kind: {kind!r} is not {GPU_CONFIG} or {MIG_DEVICE_CONFIG}")
    raw_sharing = obj.get("sharing")
    sharing = None if raw_sharing is None else _parse_sharing(raw_sharing, "sharing", kind)
    return GpuConfig(sharing) if kind == GPU_CONFIG else MigDeviceConfig(sharing)


# --- Resolution per device ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigEntry:
    """One of this driver's configs from `status.allocation.devices.config`, decoded."""

    source: str  # FromClass | FromClaim
    requests: tuple[str, ...]  # empty: every request
    config: OpaqueConfig

    def applies_to(self, request: str) -> bool:
        # A result of subrequest `req/sub` is configured by entries naming `req/sub` or `req`.
        return not self.requests or request in self.requests or request.split("/", 1)[0] in self.requests


def parse_allocation_configs(configs: Sequence[Mapping[str, Any]], driver: str) -> list[ConfigEntry]:
    """This driver's configs, lowest precedence first: class configs, then claim configs, each in order.

    Configs for other drivers are skipped: the allocation carries every driver's configs.
    """
    entries: list[ConfigEntry] = []
    for i, item in enumerate(configs):
        if not isinstance(item, Mapping):
            raise ConfigError(f"config[{i}]: want an object, got {type(item).__name__}")
        opaque = item.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != driver:
            continue
        source = item.get("source", "FromClaim")
        if source not in ("FromClass", "FromClaim"):
            raise ConfigError(f"config[{i}].source: {source!r} is not FromClass or FromClaim")
        try:
            config = parse_config(opaque.get("parameters"))
        except ConfigError as exc:
            raise ConfigError(f"config[{i}] ({source}): {exc}") from None
        requests = item.get("requests") or ()
        if not isinstance(requests, list | tuple) or not all(isinstance(r, str) for r in requests):
            raise ConfigError(f"config[{i}].requests: want a list of request names")
        entries.append(ConfigEntry(source, tuple(requests), config))
    return sorted(entries, key=lambda e: e.source != "FromClass")  # stable: keeps order within a source


@dataclass(frozen=True)
class DeviceRef:
    """What resolution needs to know of one allocated device."""

    request: str
    name: str
    type: str  # gpu | mig
    uuid: str


@dataclass(frozen=True)
class DeviceConfig:
    """The effective config of one device: its sharing, with MPS limits narrowed to this device."""

    kind: str
    sharing: Sharing | None = None
    pinned_memory_limit: Quantity | None = None  # MPS only: per-device limit, else the default

    @property
    def shared(self) -> bool:
        return self.sharing is not None


def resolve_device_configs(entries: Sequence[ConfigEntry], devices: Sequence[DeviceRef]) -> list[DeviceConfig]:
    """The config each device gets: the last entry that applies to its request wins (none: exclusive).

    An entry naming no requests applies only to devices of its kind (a claim-wide GpuConfig leaves the
    claim's MIG devices alone, as NVIDIA's driver does), and must fit at least one device (NVIDIA's driver
    ignores a MigDeviceConfig on a claim of whole GPUs; here it is the claim's error, since what it asks would
    silently not happen); one naming the request must fit the device.
    """

    def applies(entry: ConfigEntry, device: DeviceRef) -> bool:
        if not entry.applies_to(device.request):
            return False
        return bool(entry.requests) or _kind(entry) == KIND_FOR_TYPE.get(device.type)

    for claim_wide in entries:  # a claim-wide config of a kind no device takes would be silently ignored
        if not claim_wide.requests and devices and all(_kind(claim_wide) != KIND_FOR_TYPE.get(d.type) for d in devices):
            kinds = sorted({KIND_FOR_TYPE.get(d.type, d.type) for d in devices})
            raise ConfigError(
                f"the {claim_wide.source} {_kind(claim_wide)} for every request configures no device: the "
                f"claim's devices ({', '.join(d.name for d in devices)}) take {' or '.join(kinds)}"
            )
    chosen: list[ConfigEntry | None] = [next((e for e in reversed(entries) if applies(e, d)), None) for d in devices]
    resolved = []
    for device, entry in zip(devices, chosen, strict=True):
        want = KIND_FOR_TYPE.get(device.type)
        if want is None:
            raise ConfigError(f"device {device.name}: type {device.type!r} takes no config")
        if entry is None:
            resolved.append(DeviceConfig(want))
            continue
        kind = _kind(entry)
        if kind != want:
            raise ConfigError(
                f"device {device.name} (request {device.request!r}) is a {device.type} device: "
                f"it takes {want}, not {kind}"
            )
        sharing = entry.config.sharing
        limit = None
        if isinstance(sharing, Mps):
            # Indices count the devices this config entry applies to, in allocation order (as NVIDIA does).
            group = [d.uuid for d, e in zip(devices, chosen, strict=True) if e is entry]
            limit = _device_limit(sharing, group, device.uuid)
        resolved.append(DeviceConfig(kind, sharing, limit))
    return resolved


def _kind(entry: ConfigEntry) -> str:
    return GPU_CONFIG if isinstance(entry.config, GpuConfig) else MIG_DEVICE_CONFIG


def _device_limit(mps: Mps, group: Sequence[str], uuid: str) -> Quantity | None:
    limit = mps.pinned_memory_limit
    for key, value in mps.per_device_pinned_memory_limit:
        if key.isdigit():
            if int(key) >= len(group):
                raise ConfigError(
                    f"mpsConfig.defaultPerDevicePinnedMemoryLimit: index {key} is out of range "
                    f"(the config applies to {len(group)} device(s))"
                )
            target = group[int(key)]
        elif key in group:
            target = key
        else:
            raise ConfigError(f"mpsConfig.defaultPerDevicePinnedMemoryLimit: {key} is not a device of this config")
        if target == uuid:
            limit = value
    return limit
