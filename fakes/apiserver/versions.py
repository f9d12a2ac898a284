"""The Kubernetes version the fake plays: its feature-gate defaults and what `/version` answers.

Gate defaults follow upstream's versioned feature specs (pkg/features/kube_features.go) for the gates that
change what the served resource.k8s.io and scheduling.k8s.io objects may hold. `feature_gates` overrides them
as kube-apiserver's `--feature-gates` does.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

SUPPORTED = ("1.34", "1.35", "1.36", "1.37")
DEFAULT = "1.37"
ENVIRONMENT = "FAKE_KUBERNETES_VERSION"


def default_version() -> str:
    """$FAKE_KUBERNETES_VERSION (so a whole test suite can run against another release), else 1.37."""
    return os.environ.get(ENVIRONMENT) or DEFAULT


# Gate -> first minor release where it is on by default (None: off in every supported release).
_ON_BY_DEFAULT_FROM: dict[str, int | None] = {
    "DRAAdminAccess": 34,  # beta in 1.34, GA in 1.36
    "DRAPrioritizedList": 34,  # beta in 1.34, GA in 1.36
    "DRAResourceClaimDeviceStatus": 34,
    "DRADeviceTaints": 36,  # alpha 1.33-1.35, beta (on) 1.36, GA 1.37
    "DRAPartitionableDevices": 36,  # alpha 1.33-1.35, beta (on) 1.36
    "DRAConsumableCapacity": 36,  # alpha 1.34-1.35, beta (on) 1.36
    "DRAExtendedResource": 36,  # alpha 1.34-1.35, beta (on) 1.36, GA 1.37
    "DRADeviceBindingConditions": 36,  # alpha 1.34-1.35, beta 1.36
    "DRANodeAllocatableResources": None,  # alpha 1.36
    "DRAListTypeAttributes": None,  # alpha 1.36
    "DRAResourcePoolStatus": None,  # alpha 1.37
    # Upstream keeps GenericWorkload off by default (beta in 1.37, with scheduling.k8s.io/v1beta1 behind
    # --runtime-config). The fake plays the cluster this project targets at 1.37, which turns both on for the
    # arbiter's gangs; pass feature_gates={"GenericWorkload": False} for a stock 1.37 server.
    "GenericWorkload": 37,
}


@dataclass(frozen=True)
class KubernetesVersion:
    """One minor release of kube-apiserver with its effective feature gates."""

    version: str = field(default_factory=default_version)
    overrides: Mapping[str, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.version not in SUPPORTED:
            raise ValueError(f"unsupported Kubernetes version {self.version!r}: choose one of {', '.join(SUPPORTED)}")
        unknown = sorted(set(self.overrides) - set(_ON_BY_DEFAULT_FROM))
        if unknown:
            raise ValueError(f"unknown feature gates {unknown}: known are {', '.join(sorted(_ON_BY_DEFAULT_FROM))}")

    @property
    def minor(self) -> int:
        return int(self.version.split(".")[1])

    def enabled(self, gate: str) -> bool:
        if gate in self.overrides:
            return bool(self.overrides[gate])
        since = _ON_BY_DEFAULT_FROM[gate]
        return since is not None and self.minor >= since

    def version_info(self) -> dict[str, str]:
        """The body of GET /version."""
        minor = str(self.minor)
        return {
            "major": "1",
            "minor": minor,
            "gitVersion": f"v{self.version}.0",
            "gitCommit": "0" * 40,
            "gitTreeState": "clean",
            "buildDate": "2026-08-26T00:00:00Z",
            "goVersion": "go1.25.0",
            "compiler": "gc",
            "platform": "linux/amd64",
            "emulationMajor": "1",
            "emulationMinor": minor,
            "minCompatibilityMajor": "1",
            "minCompatibilityMinor": str(self.minor - 1),
        }
