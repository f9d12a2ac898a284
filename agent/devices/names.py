"""Canonical device names, compatible with NVIDIA's DRA driver, and their parsing.

Full GPU: `gpu-<minor>`. MIG: `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`, the profile
lower-cased without dots. A `+` (as in `1g.10gb+me`) is not allowed in a device name (a DNS label), so it
is written `-`: `gpu-0-mig-1g10gb-me-20-0`. The profile id and start identify the placement; the profile
text is for people and is checked against the GPU's profiles when a name is resolved.

One device has exactly one name: `gpu-01` and `gpu-1` would otherwise reach the same GPU under two names and
slip past every "already prepared" or "unhealthy" check that compares strings. `parse_device_name` accepts
only the canonical spelling (no leading zeros); `canonical` maps any spelling onto it for comparing names
that come from elsewhere (an allocation, an older checkpoint).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

# [0-9], not \d (which takes any Unicode digit), and fullmatch, not $ (which allows a trailing newline).
_GPU = re.compile(r"gpu-([0-9]+)")
_MIG = re.compile(r"gpu-([0-9]+)-mig-([a-z0-9-]+?)-([0-9]+)-([0-9]+)")
_MAX_NAME = 63  # a DRA device name is a DNS label; longer text is never parsed (nor its digits converted)


class InvalidDeviceName(ValueError):
    """A string that is not one of this driver's canonical device names."""


@dataclass(frozen=True)
class GpuName:
    minor: int

    def __str__(self) -> str:
        return gpu_device_name(self.minor)


@dataclass(frozen=True)
class MigName:
    parent_minor: int
    profile_token: str  # "1g10gb", "1g10gb-me"
    gi_profile_id: int
    start: int

    def __str__(self) -> str:
        return f"gpu-{self.parent_minor}-mig-{self.profile_token}-{self.gi_profile_id}-{self.start}"


def profile_token(profile: str) -> str:
    """`1g.10gb+me` -> `1g10gb-me`."""
    return profile.lower().replace(".", "").replace("+", "-")


def gpu_device_name(minor: int) -> str:
    return f"gpu-{minor}"


def mig_device_name(parent_minor: int, profile: str, gi_profile_id: int, start: int) -> str:
    return str(MigName(parent_minor, profile_token(profile), gi_profile_id, start))


def _parse(name: str) -> GpuName | MigName:
    if len(name) <= _MAX_NAME and (m := _GPU.fullmatch(name)):
        return GpuName(int(m.group(1)))
    if len(name) <= _MAX_NAME and (m := _MIG.fullmatch(name)):
        return MigName(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)))
    shown = name if len(name) <= _MAX_NAME else name[:_MAX_NAME] + "..."
    raise InvalidDeviceName(f"{shown!r} is not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)")


def parse_device_name(name: str) -> GpuName | MigName:
    """The device `name` names, if it is spelled exactly as this driver publishes it."""
    parsed = _parse(name)
    if str(parsed) != name:
        raise InvalidDeviceName(f"{name!r} is not a canonical device name of this driver (it would be {parsed})")
    return parsed


@functools.lru_cache(maxsize=4096)  # compared against every held device on each prepare
def canonical(name: str) -> str:
    """The canonical spelling of `name` (`gpu-01` -> `gpu-1`); a string that names no device is returned as
    is, so it matches no device."""
    try:
        return str(_parse(name))
    except InvalidDeviceName:
        return name
