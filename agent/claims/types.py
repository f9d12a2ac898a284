"""What the kubelet plugin asks of claim preparation, and what it gets back (version-neutral)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device made ready for a container: maps 1:1 to the DRA `Device` message."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class PrepareResult:
    """One claim's outcome: its devices, or a non-empty error (the batch never fails for one claim)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class Preparer(Protocol):
    """Prepares and unprepares claims; implemented by agent.claims, called by agent.kubelet."""

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Result per claim uid."""
        ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Error per claim uid; "" when unprepared (an unknown claim counts as unprepared)."""
        ...
