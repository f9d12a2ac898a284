"""Canonical device names, compatible with NVIDIA's DRA driver, and their parsing.

Full GPU: `gpu-<minor>`. MIG: `gpu-<minor>-mig-<profile>-<giProfileId>-<placementStart>`, the profile
lower-cased without dots. A `+` (as in `1g.10gb+me`) is not allowed in a device name (a DNS label), so it
is written `-`: `gpu-0-mig-1g10gb-me-20-0`. The profile id and start identify the placement; the profile
text is for people and is checked against the GPU's profiles when a name is resolved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GPU = re.compile(r"^gpu-(\d+)$")
_MIG = re.compile(r"^gpu-(\d+)-mig-([a-z0-9-]+?)-(\d+)-(\d+)$")


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


def parse_device_name(name: str) -> GpuName | MigName:
    if m := _GPU.match(name):
        return GpuName(int(m.group(1)))
    if m := _MIG.match(name):
        return MigName(int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4)))
    raise InvalidDeviceName(f"{name!r} is not a device name of this driver (gpu-<minor> or gpu-<minor>-mig-...)")
