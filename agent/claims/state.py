"""The per-claim prepare/unprepare state machine over the checkpoint and the CDI specs.

    (absent) --prepare--> PrepareStarted --CDI spec written--> PrepareCompleted --unprepare--> (absent)
                              |  crash, failure, or a later prepare/recover finds it
                              +--rollback (remove spec, forget)--> (absent)

Every transition is saved before the next side effect, so a crash anywhere leaves a state that `recover`
(or the next prepare of the claim) repairs: no spec without a Completed entry, no Completed entry
without its spec. Callers hold the node lock (agent.claims.preparer does).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent.claims import cdi
from agent.claims.cdi import CdiDevice, CdiStore, MigCaps
from agent.claims.checkpoint import Checkpoint, CheckpointedDevice, CheckpointStore, ClaimEntry, ClaimState
from agent.claims.claim import AllocatedDevice, ClaimError, node_allocation
from agent.claims.config import ConfigError, DeviceConfig, DeviceRef, Mps, TimeSlicing, resolve_device_configs
from agent.claims.source import ClaimSource
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.devices import names
from agent.devices.model import Inventory

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recovery:
    """What `recover` repaired, for the startup log."""

    rolled_back: tuple[str, ...] = ()  # claims stuck in PrepareStarted
    restored_specs: tuple[str, ...] = ()  # Completed claims whose spec file had vanished
    removed_specs: tuple[str, ...] = ()  # spec files with no Completed claim
    removed_temps: int = 0


@dataclass(frozen=True)
class _Planned:
    """One device of a claim about to be prepared."""

    checkpointed: CheckpointedDevice
    cdi: CdiDevice
    config: DeviceConfig


def _sharing_name(config: DeviceConfig) -> str:
    if isinstance(config.sharing, TimeSlicing):
        return "TimeSlicing"
    if isinstance(config.sharing, Mps):
        return "MPS"
    return ""


def _result(entry: ClaimEntry) -> PrepareResult:
    return PrepareResult(
        devices=tuple(
            PreparedDevice(d.request_names, d.pool_name, d.device_name, d.cdi_device_ids) for d in entry.devices
        )
    )


class ClaimStates:
    """Prepares and unprepares single claims; see the module docstring for the states."""

    def __init__(
        self,
        *,
        node_name: str,
        driver_name: str,
        checkpoints: CheckpointStore,
        specs: CdiStore,
        source: ClaimSource,
        inventory: Callable[[], Inventory],
        is_healthy: Callable[[str], bool] = lambda device_name: True,
        mig_caps: MigCaps | None = None,
    ) -> None:
        self.node_name = node_name
        self.driver_name = driver_name
        self.pool_name = node_name  # one pool per node, named after it
        self.checkpoints = checkpoints
        self.specs = specs
        self.source = source
        self.inventory = inventory
        self.is_healthy = is_healthy
        self.mig_caps = mig_caps or MigCaps()
        self._boot_id: str | None = None

    # --- checkpoint ---------------------------------------------------------------------------------

    def load(self) -> Checkpoint:
        """The checkpoint of this boot. Claims of an earlier boot are void (a reboot reset their devices and
        the kubelet prepares them again): their specs are removed and the checkpoint starts empty."""
        if self._boot_id is None:
            self._boot_id = self.checkpoints.boot_id()
        cp = self.checkpoints.load()
        if cp.boot_id != self._boot_id:
            log.info("node rebooted (boot id %s -> %s): voiding %d claim(s)", cp.boot_id, self._boot_id, len(cp.claims))
            for uid in cp.claims:
                self.specs.remove(uid)
            cp = Checkpoint(self._boot_id)
            self.checkpoints.save(cp)
        return cp

    # --- prepare ------------------------------------------------------------------------------------

    def prepare(self, cp: Checkpoint, refs: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """Prepare a batch. Each claim's failure is its own result; the checkpoint is saved twice per batch
        (all Started, then all Completed), not per claim, because every save costs two fsyncs."""
        results: dict[str, PrepareResult] = {}
        started: list[ClaimEntry] = []
        for ref in refs:
            if ref.uid in results or any(e.uid == ref.uid for e in started):
                continue  # the kubelet never repeats a claim in one call; answer it once if it does
            try:
                entry = self._start(cp, ref)
            except ClaimError as exc:
                results[ref.uid] = PrepareResult(error=str(exc))
                continue
            except Exception as exc:
                log.exception("preparing claim %s/%s (%s) failed", ref.namespace, ref.name, ref.uid)
                results[ref.uid] = PrepareResult(error=f"internal error: {type(exc).__name__}: {exc}")
                continue
            if entry.state is ClaimState.COMPLETED:
                results[ref.uid] = _result(entry)
            else:
                started.append(entry)
        if not started:
            return results

        self.checkpoints.save(cp)  # every Started entry is on disk before any side effect
        failed = []
        for entry in started:
            try:
                self.specs.write(entry.uid, entry.cdi_spec or {})
                # Applying TimeSlicing / MPS on the node (not done yet) belongs here, between Started and Completed.
            except Exception as exc:
                log.exception("writing the CDI spec of claim %s failed", entry.uid)
                results[entry.uid] = PrepareResult(error=f"cannot write CDI spec: {exc}")
                failed.append(entry.uid)
                continue
            cp.claims[entry.uid] = done = replace(entry, state=ClaimState.COMPLETED)
            results[entry.uid] = _result(done)
        for uid in failed:
            self.specs.remove(uid)
            del cp.claims[uid]
        self.checkpoints.save(cp)
        return results

    def _start(self, cp: Checkpoint, ref: ClaimRef) -> ClaimEntry:
        """The claim's Completed entry, or a new Started one (added to `cp`, not saved yet)."""
        entry = cp.claims.get(ref.uid)
        if entry is not None and entry.state is ClaimState.COMPLETED:
            if not self.specs.exists(ref.uid) and entry.cdi_spec is not None:
                self.specs.write(ref.uid, entry.cdi_spec)  # someone cleared the CDI root: put it back
            return entry
        if entry is not None:
            log.info("claim %s was left in PrepareStarted: rolling back before preparing again", ref.uid)
            self.rollback(cp, ref.uid)
        try:
            claim = self.source.get(ref.namespace, ref.name)
        except Exception as exc:
            raise ClaimError(f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {exc}") from exc
        planned = self._plan(cp, ref, claim)
        spec = cdi.claim_spec(ref.uid, [p.cdi for p in planned], self.node_name, self.driver_name)
        entry = ClaimEntry(
            ref.uid, ref.namespace, ref.name, ClaimState.STARTED, tuple(p.checkpointed for p in planned), spec
        )
        cp.claims[ref.uid] = entry  # later claims of the batch see its devices as taken
        return entry

    def _plan(self, cp: Checkpoint, ref: ClaimRef, claim: Mapping[str, Any]) -> list[_Planned]:
        allocation = node_allocation(claim, ref, self.driver_name, self.pool_name)
        inventory = self.inventory()
        by_device: dict[str, list[AllocatedDevice]] = {}
        for r in allocation.results:
            by_device.setdefault(r.device, []).append(r)

        resolved = [self._resolve(inventory, name) for name in by_device]
        refs = [
            DeviceRef(results[0].request, name, kind, c.uuid)
            for (name, results), (kind, c) in zip(by_device.items(), resolved, strict=True)
        ]
        try:
            configs = resolve_device_configs(allocation.configs, refs)
        except ConfigError as exc:
            raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: bad device config: {exc}") from None

        planned = []
        for (name, results), (_, cdi_device), config in zip(by_device.items(), resolved, configs, strict=True):
            device = CheckpointedDevice(
                request_names=tuple(dict.fromkeys(r.base_request for r in results)),
                pool_name=self.pool_name,
                device_name=name,
                cdi_device_ids=(cdi.device_id(ref.uid, name),),
                uuid=cdi_device.uuid,
                sharing=_sharing_name(config),
                admin_access=all(r.admin_access for r in results),
                share_id=results[0].share_id,
            )
            self._check_free(cp, ref.uid, device)
            planned.append(_Planned(device, cdi_device, config))
        return planned

    def _resolve(self, inventory: Inventory, device_name: str) -> tuple[str, CdiDevice]:
        """(device type, what the spec needs) for an allocated device that exists and is healthy here."""
        try:
            parsed = names.parse_device_name(device_name)
        except names.InvalidDeviceName as exc:
            raise ClaimError(str(exc)) from None
        if isinstance(parsed, names.GpuName):
            gpu = inventory.gpu(parsed.minor)
            if gpu is None:
                raise ClaimError(f"device {device_name} does not exist on node {self.node_name}")
            if gpu.mig_enabled:
                raise ClaimError(f"device {device_name} has MIG mode enabled: only its MIG devices can be used")
            found: tuple[str, CdiDevice] = ("gpu", CdiDevice(device_name, gpu.uuid, cdi.gpu_device_nodes(gpu.minor)))
        else:
            mig = next(
                (
                    m
                    for m in inventory.mig_devices_of(parsed.parent_minor)
                    if m.gi_profile_id == parsed.gi_profile_id
                    and m.placement.start == parsed.start
                    and names.profile_token(m.profile) == parsed.profile_token
                ),
                None,
            )
            if mig is None:
                raise ClaimError(f"MIG device {device_name} does not exist on node {self.node_name}")
            nodes = cdi.mig_device_nodes(mig.parent_minor, mig.gpu_instance_id, mig.compute_instance_id, self.mig_caps)
            found = ("mig", CdiDevice(device_name, mig.uuid, nodes))
        if not self.is_healthy(device_name):
            raise ClaimError(f"device {device_name} is unhealthy")
        return found

    def _check_free(self, cp: Checkpoint, uid: str, device: CheckpointedDevice) -> None:
        """Refuse a device another claim holds, unless the two may share it: admin access (monitoring, never
        exclusive), distinct consumable-capacity shares, or TimeSlicing/MPS configs of the same strategy."""
        if device.admin_access or device.share_id:
            return
        for other in cp.claims.values():
            if other.uid == uid:
                continue
            for held in other.devices:
                if held.device_name != device.device_name or held.admin_access or held.share_id:
                    continue
                if device.sharing and device.sharing == held.sharing:
                    continue
                hint = (
                    f"its sharing ({held.sharing or 'none'}) differs from this claim's ({device.sharing or 'none'})"
                    if device.sharing or held.sharing
                    else "claims share a device only with a TimeSlicing or MPS config in both"
                )
                raise ClaimError(
                    f"device {device.device_name} is already prepared for ResourceClaim "
                    f"{other.namespace}/{other.name} (uid {other.uid}); {hint}"
                )

    # --- unprepare and repair -----------------------------------------------------------------------

    def unprepare(self, cp: Checkpoint, uids: Sequence[str]) -> None:
        """Forget the claims, then remove their specs: a crash in between leaks only specs, which `recover`
        removes, never a Completed entry whose spec is gone. An unknown claim is already unprepared."""
        known = [uid for uid in uids if cp.claims.pop(uid, None) is not None]
        if known:
            self.checkpoints.save(cp)
        for uid in uids:
            self.specs.remove(uid)

    def rollback(self, cp: Checkpoint, uid: str) -> None:
        """Undo a PrepareStarted claim: spec first, entry last, so a crash here is rolled back again."""
        self.specs.remove(uid)
        if cp.claims.pop(uid, None) is not None:
            self.checkpoints.save(cp)

    def recover(self) -> Recovery:
        """Startup repair: roll back Started claims, restore missing specs of Completed ones, remove specs
        and temp files that no Completed claim owns."""
        cp = self.load()
        rolled_back = tuple(uid for uid, e in cp.claims.items() if e.state is ClaimState.STARTED)
        for uid in rolled_back:
            self.rollback(cp, uid)
        restored = tuple(uid for uid, e in cp.claims.items() if e.cdi_spec is not None and not self.specs.exists(uid))
        for uid in restored:
            self.specs.write(uid, cp.claims[uid].cdi_spec or {})
        removed = tuple(sorted(self.specs.claim_uids() - cp.claims.keys()))
        for uid in removed:
            self.specs.remove(uid)
        temps = self.specs.leftover_temps() + self.checkpoints.leftover_temps()
        for path in temps:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return Recovery(rolled_back, restored, removed, len(temps))


def prepared_devices(cp: Checkpoint) -> Sequence[CheckpointedDevice]:
    """Every device held by a claim in the checkpoint (for the local allocator's view of used devices)."""
    return [d for e in cp.claims.values() for d in e.devices]
