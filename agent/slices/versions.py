"""What each Kubernetes version's ResourceSlice validation accepts, so the agent publishes a shape it keeps.

Numbers are upstream's (k8s.io/api resource/v1/types.go constants at tags v0.34.0 .. v0.37.0, enforced by
kubernetes/kubernetes pkg/apis/resource/validation/validation.go `validateResourceSliceSpec`):

- 1.34: at most 128 devices a slice; `sharedCounters` at most 32 counters summed over all sets
  (ResourceSliceMaxSharedCounters); at most 1024 counters consumed by all devices of a slice
  (ResourceSliceMaxDeviceCountersPerSlice) and 32 by one device; at most 4 taints a device. Counters and the
  devices consuming them must share a slice.
- 1.35+: `sharedCounters` and `devices` are mutually exclusive in a slice ("only one of `sharedCounters` or
  `devices` is allowed"), a device may consume counter sets of any slice of its pool; at most 8 counter sets a
  slice (ResourceSliceMaxCounterSets) of 32 counters each; 64 devices in a slice where any device has taints
  or consumes counters (ResourceSliceMaxDevicesWithTaintsOrConsumesCounters, in 1.36
  ResourceSliceMaxDevicesWithAdvancedFeatures); at most 2 counter consumptions a device; 16 taints a device.

Which features a server keeps by default (pkg/features/kube_features.go): device taints (DRADeviceTaints) are
alpha and off in 1.34-1.35, beta and on in 1.36, GA in 1.37; partitionable devices (DRAPartitionableDevices)
alpha in 1.34-1.35, beta and on from 1.36; consumable capacity (DRAConsumableCapacity: allowMultipleAllocations,
requestPolicy, claims' capacity.requests) alpha in 1.34-1.35, beta and on in 1.36 and 1.37. An alpha field
written to a server with the gate off is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

OLDEST = (1, 34)  # resource.k8s.io/v1 is GA from 1.34; nothing older serves it
NEWEST = (1, 37)  # the newest version whose rules are known; later ones are assumed to keep them


@dataclass(frozen=True)
class SliceRules:
    """One Kubernetes version's rules for ResourceSlices, as far as the agent's slices are concerned."""

    version: tuple[int, int]
    separate_counters: bool  # sharedCounters in slices of their own (1.35+), else beside their devices
    taints_served: bool  # device taints kept by default (1.36+); before that they are withdrawn instead
    shares_served: bool = False  # consumable capacity (DRAConsumableCapacity) kept by default (1.36+)
    max_devices: int = 128
    max_devices_advanced: int = 64  # when any device of the slice has taints or consumes counters
    max_counter_sets: int = 8  # sharedCounters entries a slice (1.35+)
    max_counters_per_set: int = 32  # 1.35+; on 1.34 this is the limit summed over all sets of a slice
    max_counters_consumed: int = 0  # 1.34 only: counters consumed by all devices of a slice together
    max_taints: int = 16

    @property
    def label(self) -> str:
        return f"{self.version[0]}.{self.version[1]}"


RULES = {
    (1, 34): SliceRules(
        (1, 34),
        separate_counters=False,
        taints_served=False,
        max_devices_advanced=128,
        max_counter_sets=0,
        max_counters_consumed=1024,
        max_taints=4,
    ),
    (1, 35): SliceRules((1, 35), separate_counters=True, taints_served=False),
    (1, 36): SliceRules((1, 36), separate_counters=True, taints_served=True, shares_served=True),
    (1, 37): SliceRules((1, 37), separate_counters=True, taints_served=True, shares_served=True),
}
LATEST = RULES[NEWEST]

_VERSION = re.compile(r"^v?(\d+)\.(\d+)")


class UnknownServerVersion(ValueError):
    """A version string that names no major.minor."""


def parse_version(text: str) -> tuple[int, int]:
    """`v1.36.2`, `1.35`, `v1.37.0-rc.1+abc` -> (major, minor)."""
    found = _VERSION.match(text.strip())
    if not found:
        raise UnknownServerVersion(f"Kubernetes version {text!r} is not of the form v<major>.<minor>[.<patch>]")
    return int(found.group(1)), int(found.group(2))


def rules_for(version: str | tuple[int, int]) -> SliceRules:
    """The rules of a server version; a newer version than known gets the newest rules, an older one 1.34's."""
    key = parse_version(version) if isinstance(version, str) else version
    if key in RULES:
        return RULES[key]
    return RULES[NEWEST] if key > NEWEST else RULES[OLDEST]
