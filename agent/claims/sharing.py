"""The claim code's view of sharing: one call per transition of a claim, with its checkpointed devices.

`ClaimSharing` turns a claim's devices (as the checkpoint holds them) and their resolved configs into the
plan's devices, and claim-level errors into ClaimError, so agent.claims.state needs only a call per hook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from typing import Any

from agent.claimconfig.config import DeviceConfig, Mps
from agent.claims.cdi import cdi_name
from agent.claims.checkpoint import CheckpointedDevice
from agent.claims.claim import ClaimError
from agent.devices.model import Inventory
from agent.sharing.commands import SharingError
from agent.sharing.control import Adoption, SharingControl, with_device_edits
from agent.sharing.mps import alive
from agent.sharing.plan import SharedDevice, SharingConfigError


class ClaimSharing:
    def __init__(self, control: SharingControl) -> None:
        self.control = control

    def apply(
        self,
        uid: str,
        devices: Sequence[CheckpointedDevice],
        configs: Mapping[str, DeviceConfig],
        inventory: Inventory,
        spec: Mapping[str, Any] | None,
    ) -> Mapping[str, Any] | None:
        """Apply the claim's sharing; returns its CDI spec with what the containers need for it added to the
        devices that need it (those of an MPS config), not claim-wide. Raises ClaimError (the caller undoes)."""
        shared = [
            SharedDevice(d.device_name, d.uuid, _gpu_uuid(d, inventory), configs[d.device_name])
            for d in devices
            if d.device_name in configs and configs[d.device_name].shared
        ]
        if not shared:
            return spec
        try:
            edits = self.control.apply(uid, shared)
        except SharingConfigError as exc:
            raise ClaimError(f"claim {uid}: {exc}") from None
        except SharingError as exc:
            raise ClaimError(f"cannot apply the sharing of claim {uid}: {exc}") from exc
        if edits is None or spec is None:
            return spec
        served = {
            cdi_name(uid, d.device_name, d.share_id)
            for d in devices
            if d.device_name in configs and isinstance(configs[d.device_name].sharing, Mps)
        }
        return with_device_edits(spec, served, edits)

    def undo(self, uid: str) -> None:
        """Revert the claim's sharing (no-op without any). Raises ClaimError."""
        try:
            self.control.undo(uid)
        except SharingError as exc:
            raise ClaimError(f"cannot undo the sharing of claim {uid}: {exc}") from exc

    def reconcile(self, prepared: Set[str]) -> Adoption:
        return self.control.reconcile(prepared)

    def revive(self, uid: str) -> bool | None:
        """Start the claim's MPS daemon again if it is gone: True when started again, False when alive, None
        when the claim has none. Raises ClaimError."""
        try:
            return self.control.revive(uid)
        except SharingError as exc:
            raise ClaimError(
                f"the MPS control daemon of claim {uid} is gone and cannot be started again: {exc}"
            ) from exc

    def dead_daemons(self) -> dict[str, int | None]:
        """Claims whose MPS daemon's pid is gone (or was never written), with that pid. Reads files only: cheap
        enough to poll."""
        return {uid: pid for uid, pid in self.control.daemon_pids().items() if pid is None or not alive(pid)}

    def daemon_pid(self, uid: str) -> int | None:
        return self.control.mps.pid(uid)


def _gpu_uuid(device: CheckpointedDevice, inventory: Inventory) -> str:
    """The physical GPU of a device: itself, the parent of a MIG device, or the GPU a placement was made on."""
    if device.dynamic_mig is not None:
        return device.dynamic_mig.parent_uuid
    mig = next((m for m in inventory.mig_devices if m.uuid == device.uuid), None)
    return mig.parent_uuid if mig is not None else device.uuid
