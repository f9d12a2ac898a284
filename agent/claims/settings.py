"""What preparing claims needs of the node, in one object: agent.node builds it, ClaimPreparer hands it to
ClaimStates."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.claims.cdi import MigCaps
from agent.claims.mig import MigDevices
from agent.claims.sharing import ClaimSharing
from agent.devices.model import Inventory
from agent.devices.shares import ShareMode


@dataclass(frozen=True)
class PrepareSettings:
    node_name: str
    driver_name: str
    inventory: Callable[[], Inventory]  # the node's devices now
    is_healthy: Callable[[str], bool] = lambda device_name: True
    mig_caps: MigCaps | None = None  # the MIG devices' /dev/nvidia-caps nodes (None: read from the host)
    # Creates the MIG placements claims are allocated (partitionable devices) and destroys them again; None:
    # never. `on_inventory_changed` is called, under the node lock, after it did either.
    migs: MigDevices | None = None
    on_inventory_changed: Callable[[], None] = lambda: None
    sharing: ClaimSharing | None = None  # applies TimeSlicing and MPS configs (None: checked, not applied)
    # reserved(device, "namespace/name", share): the arbiter's reservation for another claim holding the device
    # (whole, for a share), "" for none (agent.reservation.protocol.ReservationBook.reserved_for_other);
    # prepare refuses such a device.
    reserved: Callable[[str, str, bool], str] = lambda device_name, claim, share: ""
    share_mode: ShareMode | None = None  # --consumable-shares: what a shared GPU holds (else its memory only)
    dev_root: Path | None = None  # where the host's /dev nodes are, when not at /dev
