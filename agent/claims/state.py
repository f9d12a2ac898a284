"""The per-claim prepare/unprepare state machine over the checkpoint and the CDI specs.

    (absent) --prepare--> PrepareStarted --MIG devices created, CDI spec written--> PrepareCompleted
                              ^  |  crash, failure, or a later prepare/recover finds it       |
                              |  +--rollback (remove spec, destroy created MIG devices, forget)--> (absent)
                              +------- unprepare of a claim that created MIG devices ---------+

Every transition is saved before the next side effect, so a crash anywhere leaves a state that `recover`
(or the next prepare of the claim) repairs: no spec without a Completed entry, no Completed entry
without its spec, no MIG device the agent created that no entry mentions. A claim whose only side effect
is its spec goes from (absent) to PrepareCompleted in one save (`_acts_beyond_spec` says why that is safe).
A claim allocated a MIG placement that does not exist yet (a partitionable device) gets it created after
its Started entry, which names the placement, is saved; the last claim holding such a device destroys it.
MIG devices an operator made are never destroyed. Callers hold the node lock (agent.claims.preparer does).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from agent.claimconfig.config import (
    MIG_DEVICE_CONFIG,
    ConfigError,
    DeviceConfig,
    DeviceRef,
    Mps,
    TimeSlicing,
    resolve_device_configs,
)
from agent.claims import cdi
from agent.claims.cdi import CdiDevice, CdiStore, MigCaps
from agent.claims.checkpoint import (
    Checkpoint,
    CheckpointedDevice,
    CheckpointStore,
    ClaimEntry,
    ClaimState,
    DynamicMig,
)
from agent.claims.claim import AllocatedDevice, ClaimError, node_allocation
from agent.claims.mig import left_behind
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.devices import deliverable, names, shares
from agent.devices.geometry import PlacedProfile, free_placements
from agent.devices.model import Gpu, Inventory

log = logging.getLogger(__name__)

Fetched = Mapping[str, Any] | Exception  # a claim as read from the API, or why it could not be


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


class _CreateFailed(ClaimError):
    def __init__(self, message: str, left_behind: bool) -> None:
        super().__init__(message)
        self.left_behind = left_behind  # part of the device may remain on the GPU


@dataclass(frozen=True)
class _Resolved:
    """An allocated device found usable here; `dynamic` when it is (or will be) a MIG device we created."""

    type: str  # gpu | mig
    cdi: CdiDevice  # uuid "" and no device nodes while the device is still to be created
    dynamic: DynamicMig | None = None
    switches_mig_mode: bool = False  # prepare switches the GPU's MIG mode for it (see deliverable)


def _sharing_name(config: DeviceConfig) -> str:
    if isinstance(config.sharing, TimeSlicing):
        return "TimeSlicing"
    if isinstance(config.sharing, Mps):
        return "MPS"
    return ""


def _notices(entry: ClaimEntry, configs: Mapping[str, DeviceConfig]) -> tuple[tuple[str, str], ...]:
    """What the user should hear of a claim just prepared: a MIG device configured for TimeSlicing is prepared
    (as NVIDIA's driver does) but gets no time slice, which a MIG device cannot have (agent.sharing.plan)."""
    untimed = [
        d.device_name
        for d in entry.devices
        if (c := configs.get(d.device_name)) is not None
        and c.kind == MIG_DEVICE_CONFIG
        and isinstance(c.sharing, TimeSlicing)
    ]
    if not untimed:
        return ()
    return (
        (
            "MigTimeSliceNotSet",
            f"MIG device(s) {', '.join(untimed)} are shared by time as configured, but a "
            "MIG device's time slice cannot be set: processes on it take turns at the driver's default time slice",
        ),
    )


def _result(entry: ClaimEntry) -> PrepareResult:
    return PrepareResult(
        devices=tuple(
            PreparedDevice(d.request_names, d.pool_name, d.device_name, d.cdi_device_ids) for d in entry.devices
        )
    )


class ClaimStates:
    """Prepares and unprepares single claims; see the module docstring for the states."""

    def __init__(self, settings: PrepareSettings, *, checkpoints: CheckpointStore, specs: CdiStore) -> None:
        self.node_name = settings.node_name
        self.dev_root = settings.dev_root
        self.driver_name = settings.driver_name
        self.pool_name = settings.node_name  # one pool per node, named after it
        self.checkpoints = checkpoints
        self.specs = specs
        self.inventory = settings.inventory
        self.is_healthy = settings.is_healthy
        self.mig_caps = settings.mig_caps or MigCaps()
        self.migs = settings.migs
        self.on_inventory_changed = settings.on_inventory_changed
        self.sharing = settings.sharing
        self.reserved = settings.reserved
        self.share_mode = settings.share_mode
        self._boot_id: str | None = None
        self._migs_changed = False

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
            cp = Checkpoint(self._boot_id, fenced=cp.fenced)  # a fenced record is no one's to void
            self.checkpoints.save(cp)
        for uid, fenced in cp.fenced.items():
            if not fenced.devices:  # nothing readable in it: the devices its CDI spec gives containers stay held
                cp.fenced[uid] = replace(fenced, devices=self._spec_devices(uid))
        return cp

    def _spec_devices(self, uid: str) -> tuple[str, ...]:
        try:
            spec = self.specs.read(uid)
        except (OSError, ValueError):  # no spec (or none readable), or a uid no file may have
            return ()
        return cdi.device_names(spec, uid) if isinstance(spec, dict) else ()

    # --- prepare ------------------------------------------------------------------------------------

    def prepare(
        self, cp: Checkpoint, refs: Sequence[ClaimRef], claims: Mapping[str, Fetched]
    ) -> dict[str, PrepareResult]:
        """Prepare a batch. `claims` holds each claim as read from the API before the node lock was taken
        (or why it could not be read); a claim left out was Completed when the caller looked. Each claim's
        failure is its own result; the checkpoint is saved twice per batch (all Started, then all
        Completed), not per claim, because every save costs fsyncs; the Started save only where a claim
        does more than write its spec (`_acts_beyond_spec`)."""
        try:
            return self._prepare(cp, refs, claims)
        finally:
            self._report_mig_changes()

    def _prepare(
        self, cp: Checkpoint, refs: Sequence[ClaimRef], claims: Mapping[str, Fetched]
    ) -> dict[str, PrepareResult]:
        results: dict[str, PrepareResult] = {}
        started: dict[str, tuple[ClaimEntry, list[CdiDevice], dict[str, DeviceConfig]]] = {}
        for ref in refs:  # distinct claims: agent.kubelet.dra screens the kubelet's batch
            try:
                entry, devices, configs = self._start(cp, ref, claims.get(ref.uid))
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
                started[ref.uid] = (entry, devices, configs)
        if not started:
            return results

        if any(_acts_beyond_spec(entry, configs, self.sharing is not None) for entry, _, configs in started.values()):
            self.checkpoints.save(cp)  # every Started entry (with the placements to create) is on disk first
        for begun, devices, configs in started.values():
            try:
                self._switch_mig_modes(begun)
                entry = self._create_migs(cp, begun, devices)
                if self.sharing is not None:  # undone by _abandon, rollback or recover like the MIG devices
                    spec = self.sharing.apply(entry.uid, entry.devices, configs, self.inventory(), entry.cdi_spec)
                    cp.claims[entry.uid] = entry = replace(entry, cdi_spec=spec)
                self.specs.write(entry.uid, entry.cdi_spec or {})
            except Exception as exc:
                if not isinstance(exc, ClaimError):
                    log.exception("writing the CDI spec of claim %s failed", begun.uid)
                error = str(exc) if isinstance(exc, ClaimError) else f"cannot write CDI spec: {exc}"
                results[begun.uid] = PrepareResult(error=self._abandon(cp, begun.uid, error, left_behind(exc)))
                continue
            cp.claims[entry.uid] = done = replace(entry, state=ClaimState.COMPLETED)
            results[entry.uid] = replace(_result(done), notices=_notices(done, configs))
        self.checkpoints.save(cp)
        return results

    def _switch_mig_modes(self, entry: ClaimEntry) -> None:
        """Turn MIG mode on for MIG devices to create, off for whole GPUs, where the claim's Started record
        says prepare switches it (a no-op where another claim already did)."""
        for device in entry.devices:
            if device.mig_mode_switched:
                self._set_mig_mode(device, on=device.dynamic_mig is not None)

    def _set_mig_mode(self, device: CheckpointedDevice, *, on: bool) -> None:
        parent = _parent_uuid(device)
        if self.migs is None:
            raise ClaimError(f"device {device.device_name} needs a MIG mode change, and this agent has no NVML")
        try:
            self.migs.switch_mig_mode(parent, on)
        except Exception as exc:
            raise ClaimError(
                f"cannot turn MIG mode {'on' if on else 'off'} on the GPU of {device.device_name}: {exc}"
            ) from exc
        self._migs_changed = True

    def _create_migs(self, cp: Checkpoint, entry: ClaimEntry, devices: list[CdiDevice]) -> ClaimEntry:
        """Create the claim's MIG devices still to be made, recording each in `cp` as soon as it exists (in
        memory: the Completed save writes the ids; a crash before it is repaired from the placement), then
        build the spec with their uuids and device nodes."""
        if not any(_to_create(d) for d in entry.devices):
            return entry
        assert self.migs is not None  # _resolve plans creations only with it
        for i, device in enumerate(entry.devices):
            if (plan := _to_create(device)) is None:
                continue
            try:
                made = self.migs.create(plan.parent_uuid, plan.gi_profile_id, plan.start)
            except Exception as exc:
                raise _CreateFailed(f"cannot create MIG device {device.device_name}: {exc}", left_behind(exc)) from exc
            self._migs_changed = True
            created = replace(plan, gpu_instance_id=made.gpu_instance_id, compute_instance_id=made.compute_instance_id)
            updated = list(entry.devices)
            updated[i] = replace(device, uuid=made.uuid, dynamic_mig=created)
            cp.claims[entry.uid] = entry = replace(entry, devices=tuple(updated))
            parsed = names.parse_device_name(device.device_name)
            assert isinstance(parsed, names.MigName)
            nodes = cdi.mig_device_nodes(
                parsed.parent_minor, made.gpu_instance_id, made.compute_instance_id, self.mig_caps
            )
            devices[i] = CdiDevice(device.device_name, made.uuid, nodes)
        spec = cdi.claim_spec(entry.uid, devices, self.node_name, self.driver_name, self.dev_root)
        cp.claims[entry.uid] = entry = replace(entry, cdi_spec=spec)
        return entry

    def _abandon(self, cp: Checkpoint, uid: str, error: str, keep: bool) -> str:
        """Undo a claim that failed after its Started save (in memory; the caller saves): spec, created MIG
        devices, entry. The entry stays Started when something may be left on the GPU, for a later repair.
        A spec that cannot be removed (the CDI root turned read-only) does not keep the entry: a spec with no
        Completed claim is inert (the kubelet names its devices to the runtime only after a prepare that
        succeeded) and the next prepare of the claim, or recovery, replaces or removes it."""
        if problem := self._remove_spec(uid):
            error = f"{error}; {problem}"
        entry = cp.claims[uid]
        try:
            self._undo_sharing(uid)
            self._destroy_created(cp, entry, find_unsaved=False)
        except ClaimError as exc:
            return f"{error}; {exc}"
        if not keep:
            del cp.claims[uid]
        return error

    def _start(
        self, cp: Checkpoint, ref: ClaimRef, fetched: Fetched | None
    ) -> tuple[ClaimEntry, list[CdiDevice], dict[str, DeviceConfig]]:
        """The claim's Completed entry, or a new Started one (added to `cp`, not saved yet) with its devices
        as the spec needs them. A Started entry's spec is left out while MIG devices are still to be made."""
        if (fenced := cp.fenced.get(ref.uid)) is not None:
            raise ClaimError(f"{fenced.describe()}; the claim is fenced until then")
        entry = cp.claims.get(ref.uid)
        if entry is not None and (entry.namespace, entry.name) != (ref.namespace, ref.name):
            # A UID names one claim for its whole life: another name for it is a confused or forged request,
            # and answering it would hand that caller the stored claim's devices.
            raise ClaimError(
                f"claim UID {ref.uid} is prepared here as ResourceClaim {entry.namespace}/{entry.name}, "
                f"not {ref.namespace}/{ref.name}: refused"
            )
        if entry is not None and entry.state is ClaimState.COMPLETED:
            if not self.specs.exists(ref.uid) and entry.cdi_spec is not None:
                self.specs.write(ref.uid, entry.cdi_spec)  # someone cleared the CDI root: put it back
            if self.sharing is not None and self.sharing.revive(ref.uid):  # its containers need the daemon
                log.warning("the MPS control daemon of claim %s had died: started again at its re-prepare", ref.uid)
            return entry, [], {}
        if entry is not None:
            log.info("claim %s was left in PrepareStarted: rolling back before preparing again", ref.uid)
            self.rollback(cp, ref.uid)
        if fetched is None:  # it was Completed when the caller looked, and another agent unprepared it since
            raise ClaimError(
                f"ResourceClaim {ref.namespace}/{ref.name} was unprepared while being prepared; "
                "the kubelet's retry prepares it"
            )
        if isinstance(fetched, Exception):
            raise ClaimError(f"cannot read ResourceClaim {ref.namespace}/{ref.name}: {fetched}")
        planned = self._plan(cp, ref, fetched)
        devices = [p.cdi for p in planned]
        to_create = any(_to_create(p.checkpointed) for p in planned)
        spec = None if to_create else cdi.claim_spec(ref.uid, devices, self.node_name, self.driver_name, self.dev_root)
        entry = ClaimEntry(
            ref.uid, ref.namespace, ref.name, ClaimState.STARTED, tuple(p.checkpointed for p in planned), spec
        )
        cp.claims[ref.uid] = entry  # later claims of the batch see its devices (and placements) as taken
        return entry, devices, {p.checkpointed.device_name: p.config for p in planned}

    def _plan(self, cp: Checkpoint, ref: ClaimRef, claim: Mapping[str, Any]) -> list[_Planned]:
        allocation = node_allocation(claim, ref, self.driver_name, self.pool_name)
        inventory = self.inventory()
        by_device: dict[tuple[str, str], list[AllocatedDevice]] = {}  # (device, shareID): each share alone
        for r in allocation.results:
            by_device.setdefault((r.device, r.share_id), []).append(r)

        # The other claims' entries for each device, scanned once (every claim held is looked at).
        held_by = {name: list(_held_by_others(cp, ref.uid, name)) for name, _ in by_device}
        resolved: list[_Resolved] = []
        for name, _ in by_device:
            pending = [r.dynamic for r in resolved if r.dynamic]
            resolved.append(self._resolve(cp, inventory, ref.uid, name, pending=pending, held=held_by[name]))
        refs = [
            DeviceRef(results[0].request, name, r.type, r.cdi.uuid)
            for ((name, _), results), r in zip(by_device.items(), resolved, strict=True)
        ]
        try:
            configs = resolve_device_configs(allocation.configs, refs)
        except ConfigError as exc:
            raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: bad device config: {exc}") from None

        planned: list[_Planned] = []
        for ((name, share_id), results), found, config in zip(by_device.items(), resolved, configs, strict=True):
            device = CheckpointedDevice(
                request_names=tuple(dict.fromkeys(r.base_request for r in results)),
                pool_name=self.pool_name,
                device_name=name,
                cdi_device_ids=(cdi.device_id(ref.uid, name, share_id),),
                uuid=found.cdi.uuid,
                sharing=_sharing_name(config),
                admin_access=all(r.admin_access for r in results),
                share_id=share_id,
                consumed=results[0].consumed,
                dynamic_mig=found.dynamic,
                mig_mode_switched=found.switches_mig_mode,
            )
            held = held_by[name]
            if share_id:
                self._check_share(ref, device, held, [p.checkpointed for p in planned], inventory)
            self._check_free(device, held)
            self._check_unfenced(cp, device)
            holder = "" if device.admin_access else self.reserved(name, f"{ref.namespace}/{ref.name}", bool(share_id))
            if holder:
                # the queue arbiter holds it for a gang it is committing: one holder per device (shares beside
                # shares)
                raise ClaimError(f"device {name} is reserved for another claim: {holder}")
            planned.append(_Planned(device, replace(found.cdi, share_id=share_id), config))
        return _with_share_limits(planned, inventory)

    def _resolve(
        self,
        cp: Checkpoint,
        inventory: Inventory,
        uid: str,
        device_name: str,
        *,
        pending: Sequence[DynamicMig],
        held: Sequence[tuple[ClaimEntry, CheckpointedDevice]],
    ) -> _Resolved:
        """An allocated device that exists and is healthy here, or a free MIG placement to create.
        `pending`: placements this claim already plans to create; `held`: the other claims' entries for it."""
        try:
            parsed = names.parse_device_name(device_name)
        except names.InvalidDeviceName as exc:
            raise ClaimError(str(exc)) from None
        if isinstance(parsed, names.GpuName):
            gpu = inventory.gpu(parsed.minor)
            if gpu is None:
                raise ClaimError(f"device {device_name} does not exist on node {self.node_name}")
            switch = self._whole_gpu_switch(cp, inventory, gpu, device_name, held)
            nodes = cdi.gpu_device_nodes(gpu.minor)
            found = _Resolved("gpu", CdiDevice(device_name, gpu.uuid, nodes), switches_mig_mode=switch)
        elif (created := next((d for _, d in held if d.dynamic_mig is not None), None)) is not None:
            # Made for another claim (the inventory may not show it yet): share it, and its destruction.
            plan = created.dynamic_mig
            assert plan is not None
            if plan.gpu_instance_id is None or plan.compute_instance_id is None:
                raise ClaimError(f"MIG device {device_name} is being created for another claim; try again")
            nodes = cdi.mig_device_nodes(
                parsed.parent_minor, plan.gpu_instance_id, plan.compute_instance_id, self.mig_caps
            )
            found = _Resolved("mig", CdiDevice(device_name, created.uuid, nodes), plan, created.mig_mode_switched)
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
            if mig is not None:
                nodes = cdi.mig_device_nodes(
                    mig.parent_minor, mig.gpu_instance_id, mig.compute_instance_id, self.mig_caps
                )
                found = _Resolved("mig", CdiDevice(device_name, mig.uuid, nodes))
            else:
                plan, switch = self._plan_creation(cp, inventory, uid, parsed, device_name=device_name, pending=pending)
                found = _Resolved("mig", CdiDevice(device_name, "", ()), plan, switch)
        if not self.is_healthy(device_name):
            raise ClaimError(f"device {device_name} is unhealthy")
        return found

    def _whole_gpu_switch(
        self,
        cp: Checkpoint,
        inventory: Inventory,
        gpu: Gpu,
        device_name: str,
        held: Sequence[tuple[ClaimEntry, CheckpointedDevice]],
    ) -> bool:
        """Whether prepare turns MIG mode off for this whole GPU (and unprepare back on), or a ClaimError
        where the GPU cannot run as a whole: MIG mode on and not switchable without a reset, or in use.
        `held`: the other claims' entries for it."""
        if not gpu.mig_enabled:  # off: switched off by another claim holding it, or never on
            return any(d.mig_mode_switched for _, d in held)
        if self.migs is None or not deliverable.switches_mig_mode_at_once(gpu):
            raise ClaimError(f"device {device_name} has MIG mode enabled: only its MIG devices can be used")
        in_use = bool(gpu.gpu_instances or inventory.mig_devices_of(gpu.minor)) or any(
            d.dynamic_mig is not None and d.dynamic_mig.parent_uuid == gpu.uuid
            for e in cp.claims.values()
            for d in e.devices
        )
        if in_use:
            raise ClaimError(f"device {device_name} has MIG devices: it cannot run as a whole GPU until they go")
        return True

    def _plan_creation(
        self,
        cp: Checkpoint,
        inventory: Inventory,
        uid: str,
        name: names.MigName,
        *,
        device_name: str,
        pending: Sequence[DynamicMig],
    ) -> tuple[DynamicMig, bool]:
        """The placement to create for a MIG device that does not exist, if it is one of the GPU's possible
        placements and still free (no overlap with existing GPU instances or other claims' creations, and
        within the profile's instance limit); and whether prepare turns MIG mode on for it (see
        agent.devices.deliverable), which the last claim holding a device so made turns off again."""
        missing = f"MIG device {device_name} does not exist on node {self.node_name}"
        gpu = inventory.gpu(name.parent_minor)
        profile = gpu.profile(name.gi_profile_id) if gpu is not None else None
        if gpu is None or profile is None or names.profile_token(profile.name) != name.profile_token:
            raise ClaimError(f"{missing}, nor is it a MIG profile of a GPU there")
        placement = next((p for p in profile.placements if p.start == name.start), None)
        if placement is None:
            starts = [p.start for p in profile.placements]
            raise ClaimError(f"{missing}: {name.start} is not a placement of {profile.name} (starts: {starts})")
        if self.migs is None:
            raise ClaimError(f"{missing}, and this agent does not create MIG devices")
        whole = names.gpu_device_name(gpu.minor)
        if not gpu.mig_enabled:
            if not deliverable.switches_mig_mode_at_once(gpu):
                raise ClaimError(f"{missing} and cannot be created: GPU {gpu.minor} does not have MIG mode enabled")
            if (holder := next(_held_by_others(cp, uid, whole), None)) is not None:
                raise ClaimError(
                    f"{missing} and cannot be created: GPU {gpu.minor} is prepared as a whole GPU "
                    f"for ResourceClaim {holder[0].namespace}/{holder[0].name}"
                )
        switch = not gpu.mig_enabled or any(
            d.mig_mode_switched and d.dynamic_mig is not None and d.dynamic_mig.parent_uuid == gpu.uuid
            for e in cp.claims.values()
            for d in e.devices
        )
        occupied = _occupied(cp, gpu, inventory, pending)
        if placement not in free_placements(profile, occupied, gpu.mig_profiles):
            raise ClaimError(
                f"{missing} and cannot be created: placement taken (it overlaps a MIG instance on GPU "
                f"{gpu.minor}, or the GPU has no room for another {profile.name})"
            )
        return DynamicMig(gpu.uuid, profile.gi_profile_id, placement.start), switch

    def _check_share(
        self,
        ref: ClaimRef,
        device: CheckpointedDevice,
        held: Sequence[tuple[ClaimEntry, CheckpointedDevice]],
        mine: Sequence[CheckpointedDevice],
        inventory: Inventory,
    ) -> None:
        """A share of a consumable-capacity GPU: refused when it comes with a TimeSlicing or MPS config (both
        change the whole GPU, which other claims' shares use), and when it and the GPU's other shares would
        consume more than the GPU has (a scheduler bug, or an allocation made from stale slices)."""
        what = f"ResourceClaim {ref.namespace}/{ref.name}"
        if device.sharing:
            raise ClaimError(
                f"{what}: device {device.device_name} is a share of a GPU other claims use too; "
                f"its {device.sharing} config would change the whole GPU for them (use no sharing "
                "config with consumable shares)"
            )
        parsed = names.parse_device_name(device.device_name)
        gpu = inventory.gpu(parsed.minor) if isinstance(parsed, names.GpuName) else None
        if gpu is None:
            raise ClaimError(
                f"{what}: share {device.share_id} is of {device.device_name}, which is not a whole GPU "
                f"on node {self.node_name}; only whole GPUs are shared by capacity"
            )
        if self.share_mode is not None:
            capacities = shares.capacities(gpu.memory_bytes, self.share_mode)
        else:  # published without shares now (e.g. the server dropped them): the GPU's memory still bounds them
            capacities = {shares.MEMORY: shares.Capacity(Fraction(gpu.memory_bytes))}
        # Only a value the published request policy can produce is trusted: a negative one would offset the
        # other shares, a missing one set no limit, and a missing `shares` let one share too many in.
        if problem := shares.consumed_problem(dict(device.consumed), capacities, every=self.share_mode is not None):
            given = ", ".join(f"{k}={v}" for k, v in device.consumed) or "nothing"
            raise ClaimError(
                f"{what}: share {device.share_id} of {device.device_name} consumes {given[:200]}: "
                f"{problem}; no allocation from this node's slices has that: refused"
            )
        others = [d for _, d in held if d.share_id]
        others += [d for d in mine if d.device_name == device.device_name and d.share_id]
        this = _consumed(device)
        if not shares.fits(this, capacities, [_consumed(d) for d in others]):
            used = {k: sum((_consumed(d).get(k, Fraction(0)) for d in others), Fraction(0)) for k in capacities}
            raise ClaimError(
                f"{what}: share {device.share_id} of {device.device_name} ({shares.describe(this) or 'nothing'}) "
                f"does not fit beside the {len(others)} share(s) prepared on it ({shares.describe(used)} of "
                f"{shares.describe({k: c.value for k, c in capacities.items()})}): the allocation is stale or "
                "wrong; it is refused so no share loses memory it was promised"
            )

    def _check_free(self, device: CheckpointedDevice, holders: Sequence[tuple[ClaimEntry, CheckpointedDevice]]) -> None:
        """Refuse a device another claim holds (`holders`: their entries for it), unless the two may share it:
        admin access (monitoring, never exclusive), consumable-capacity shares (each checked by `_check_share`),
        or TimeSlicing/MPS configs of the same strategy. A share and a whole-device claim never meet on one
        device."""
        if device.admin_access:
            return
        for other, held in holders:
            if held.admin_access or (held.share_id and device.share_id):
                continue
            if held.share_id or device.share_id:
                raise ClaimError(
                    f"device {device.device_name} is already prepared for ResourceClaim {other.namespace}/"
                    f"{other.name} (uid {other.uid}) {'as a share' if held.share_id else 'as a whole device'}; "
                    f"this claim holds it {'as a share' if device.share_id else 'whole'}: a GPU is either "
                    "shared by capacity or held whole"
                )
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

    def _check_unfenced(self, cp: Checkpoint, device: CheckpointedDevice) -> None:
        """Refuse a device that a fenced record names (its claim may still use it), unless admin access."""
        wanted = names.canonical(device.device_name)
        for fenced in cp.fenced.values():
            if not device.admin_access and any(names.canonical(d) == wanted for d in fenced.devices):
                raise ClaimError(f"device {device.device_name} stays held: {fenced.describe()}")

    # --- unprepare and repair -----------------------------------------------------------------------

    def unprepare(self, cp: Checkpoint, uids: Sequence[str]) -> dict[str, str]:
        """Forget the claims, then remove their specs: a crash in between leaks only specs, which `recover`
        removes, never a Completed entry whose spec is gone. An unknown claim is already unprepared.

        A claim holding MIG devices we created goes back to PrepareStarted first, then is rolled back: a
        crash at any point leaves an entry naming the devices, so they are never leaked. Returns an error
        per claim ("" when unprepared); a device that cannot be destroyed (in use) keeps its claim. A claim
        whose record is fenced (agent.claims.checkpoint) is not unprepared: what it holds cannot be known, so
        its error names the record and the remedy, its spec, sharing and devices stay, and the kubelet's retry
        after the record is moved aside unprepares it (spec removed, as for any claim without a record)."""
        try:
            return self._unprepare(cp, uids)
        finally:
            self._report_mig_changes()

    def _unprepare(self, cp: Checkpoint, uids: Sequence[str]) -> dict[str, str]:
        known = [uid for uid in dict.fromkeys(uids) if uid in cp.claims]
        errors = {uid: f"{cp.fenced[uid].describe()}; not unprepared until then" for uid in uids if uid in cp.fenced}
        for uid in list(known):  # sharing first, while the claim is still prepared (a failure keeps it so)
            try:
                self._undo_sharing(uid)
            except ClaimError as exc:
                errors[uid] = str(exc)
                known.remove(uid)
        owning = []  # claims holding MIG devices we created
        for uid in known:
            entry = cp.claims[uid]
            if any(d.dynamic_mig or d.mig_mode_switched for d in entry.devices):
                cp.claims[uid] = replace(entry, state=ClaimState.STARTED)
                owning.append(uid)
            else:
                del cp.claims[uid]
        if known:
            self.checkpoints.save(cp)
        for uid in uids:  # also for unknown claims: a spec left by a failed removal goes on the retry
            if uid in errors:
                continue  # its sharing could not be undone: it stays prepared, spec included
            if problem := self._remove_spec(uid):
                errors[uid] = problem  # the kubelet retries; the claim is forgotten, so only the spec remains
        destroyed = False
        for uid in owning:
            try:
                self._destroy_created(cp, cp.claims[uid], find_unsaved=True)
            except ClaimError as exc:
                errors[uid] = f"{errors[uid]}; {exc}" if uid in errors else str(exc)
                continue
            del cp.claims[uid]
            destroyed = True
        if destroyed:
            self.checkpoints.save(cp)
        return {uid: errors.get(uid, "") for uid in uids}

    def rollback(self, cp: Checkpoint, uid: str) -> None:
        """Undo a PrepareStarted claim: spec first, then the MIG devices it created, entry last, so a crash
        here is rolled back again. Raises ClaimError (entry kept) when a device cannot be destroyed or its
        sharing undone; a spec that cannot be removed is left for recovery (see `_abandon`)."""
        self._remove_spec(uid)
        self._undo_sharing(uid)
        entry = cp.claims.get(uid)
        if entry is None:
            return
        self._destroy_created(cp, entry, find_unsaved=True)
        del cp.claims[uid]
        self.checkpoints.save(cp)

    def _undo_sharing(self, uid: str) -> None:
        if self.sharing is not None:
            self.sharing.undo(uid)

    def _destroy_created(self, cp: Checkpoint, entry: ClaimEntry, *, find_unsaved: bool) -> None:
        """Destroy the MIG devices `entry` created that no other claim holds. With `find_unsaved`, a
        placement whose ids were never saved (a crash right after creating) is looked up on the GPU."""
        for device in entry.devices:
            plan = device.dynamic_mig
            if plan is None or any(_held_by_others(cp, entry.uid, device.device_name)):
                continue
            if not plan.created and not find_unsaved:
                continue
            if self.migs is None:
                raise ClaimError(
                    f"MIG device {device.device_name} was created for claim {entry.uid}, "
                    "but this agent cannot destroy MIG devices (no NVML)"
                )
            try:
                if plan.created:
                    self.migs.destroy(plan.parent_uuid, plan.gpu_instance_id or 0, plan.compute_instance_id)
                elif not self.migs.destroy_at(plan.parent_uuid, plan.gi_profile_id, plan.start):
                    continue  # it was never made
            except Exception as exc:
                raise ClaimError(
                    f"cannot destroy MIG device {device.device_name} created for claim {entry.uid}: {exc}"
                ) from exc
            log.info("destroyed MIG device %s (created for claim %s)", device.device_name, entry.uid)
            self._migs_changed = True
        self._switch_back(cp, entry)

    def _switch_back(self, cp: Checkpoint, entry: ClaimEntry) -> None:
        """Undo the MIG mode switches of `entry` that no other claim still needs: MIG mode off again once the
        last device created under a switch is gone, on again once the last claim of a whole GPU is."""
        for device in entry.devices:
            if not device.mig_mode_switched:
                continue
            parent = _parent_uuid(device)
            if any(
                d.mig_mode_switched and _parent_uuid(d) == parent
                for other in cp.claims.values()
                if other.uid != entry.uid
                for d in other.devices
            ):
                continue
            self._set_mig_mode(device, on=device.dynamic_mig is None)
            log.info("switched MIG mode of the GPU of %s back (claim %s)", device.device_name, entry.uid)

    def _remove_spec(self, uid: str) -> str:
        """Remove the claim's spec; "" when gone, else why not (logged here, returned for the claim's error)."""
        try:
            self.specs.remove(uid)
        except OSError as exc:
            log.warning("cannot remove the CDI spec of claim %s: %s", uid, exc)
            return f"cannot remove CDI spec {self.specs.path(uid)}: {exc.strerror or exc}"
        return ""

    def _report_mig_changes(self) -> None:
        if self._migs_changed:
            self._migs_changed = False
            self.on_inventory_changed()

    def recover(self) -> Recovery:
        """Startup repair: roll back Started claims (destroying MIG devices they created), restore missing
        specs of Completed ones, remove specs and temp files that no Completed claim owns. MIG devices no
        entry names are left alone: only the checkpoint says which ones this agent made."""
        try:
            return self._recover()
        finally:
            self._report_mig_changes()

    def _recover(self) -> Recovery:
        cp = self.load()
        rolled_back = []
        for uid in [uid for uid, e in cp.claims.items() if e.state is ClaimState.STARTED]:
            try:
                self.rollback(cp, uid)
            except ClaimError as exc:  # keep starting: the entry stays, a later prepare or restart retries
                log.error("claim %s stays in PrepareStarted: %s", uid, exc)  # noqa: TRY400 (the cause is in it)
                continue
            rolled_back.append(uid)
        if self.sharing is not None:  # after rollbacks: stop daemons of claims gone, adopt the others' (and fenced)
            prepared = {u for u, e in cp.claims.items() if e.state is ClaimState.COMPLETED} | cp.fenced.keys()
            adoption = self.sharing.reconcile(prepared)
            log.info(
                "sharing reconciled",
                extra={
                    "mps_adopted": adoption.adopted,
                    "mps_restarted": adoption.restarted,
                    "sharing_undone": adoption.undone,
                },
            )
        restored = tuple(
            uid
            for uid, e in cp.claims.items()
            if e.state is ClaimState.COMPLETED and e.cdi_spec is not None and not self.specs.exists(uid)
        )
        for uid in restored:
            self.specs.write(uid, cp.claims[uid].cdi_spec or {})
        removed = tuple(sorted(self.specs.claim_uids() - cp.claims.keys() - cp.fenced.keys()))
        for uid in removed:
            self.specs.remove(uid)
        temps = self.specs.leftover_temps() + self.checkpoints.leftover_temps()
        for path in temps:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        return Recovery(tuple(rolled_back), restored, removed, len(temps))


def _acts_beyond_spec(entry: ClaimEntry, configs: Mapping[str, DeviceConfig], sharing_applied: bool) -> bool:
    """Whether preparing the claim changes anything on the node besides writing its CDI spec: a MIG device to
    create, a MIG mode to switch, a TimeSlicing or MPS config to apply (`sharing_applied`: this agent applies
    them).

    Only such a claim needs its Started record on disk before prepare goes on; for the others (most claims)
    the record would cost a file write and a rename and protect nothing, because:
    - the spec is their only side effect, and recovery already removes a spec no Completed record owns (and
      the next prepare of the claim replaces it), which is what rolling back their Started record would do;
    - a spec without a Completed record is inert: the kubelet names a claim's CDI devices to the runtime only
      after its prepare succeeded, which is after the Completed record is written;
    - nothing else reads a Started record in flight: its devices are held in memory, under the node lock,
      which every other reader that decides on them (a second agent, reservations, a MIG change) takes first.
    So a kill -9 at any point leaves no device prepared for a claim without a Completed record of it: before
    that record, at most an inert spec that recovery removes (a power loss voids every claim anyway)."""
    if any(_to_create(d) or d.mig_mode_switched for d in entry.devices):
        return True
    return sharing_applied and any(config.shared for config in configs.values())


def _consumed(device: CheckpointedDevice) -> dict[str, Fraction]:
    return shares.consumed_of(dict(device.consumed))


def _with_share_limits(planned: list[_Planned], inventory: Inventory) -> list[_Planned]:
    """Each share's memory limit where the container's CUDA sees it: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, keyed by
    device ordinal. The ordinals are the claim's GPUs in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID), and a
    GPU held as several shares gets their sum; every share device carries the same value, so a container
    given several of them sees one consistent setting."""
    if not any(p.checkpointed.share_id for p in planned):
        return planned
    buses = {g.uuid: g.pci_bus_id for g in inventory.gpus}
    gpus = sorted(dict.fromkeys(p.cdi.uuid for p in planned), key=lambda u: buses.get(u, u))
    limits: dict[str, int] = {}
    for p in planned:
        memory = _consumed(p.checkpointed).get(shares.MEMORY)
        if p.checkpointed.share_id and memory:
            limits[p.cdi.uuid] = limits.get(p.cdi.uuid, 0) + -(-int(memory) // shares.MIB)
    if not limits:
        return planned
    value = ",".join(f"{i}={limits[u]}M" for i, u in enumerate(gpus) if u in limits)
    env = ("CUDA_DEVICE_ORDER=PCI_BUS_ID", f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={value}")
    return [replace(p, cdi=replace(p.cdi, env=env)) if p.checkpointed.share_id else p for p in planned]


def _parent_uuid(device: CheckpointedDevice) -> str:
    """The uuid of the GPU a device is (whole) or is carved from (created MIG device)."""
    return device.dynamic_mig.parent_uuid if device.dynamic_mig is not None else device.uuid


def _to_create(device: CheckpointedDevice) -> DynamicMig | None:
    """The MIG placement prepare has still to create for `device`, if any."""
    plan = device.dynamic_mig
    return plan if plan is not None and not plan.created else None


def _held_by_others(cp: Checkpoint, uid: str, device_name: str) -> Iterator[tuple[ClaimEntry, CheckpointedDevice]]:
    """Every other claim in `cp` that holds `device_name`, with its entry for the device (compared in the
    canonical spelling: a checkpoint of an older agent may hold a device under another)."""
    wanted = names.canonical(device_name)
    for other in cp.claims.values():
        if other.uid != uid:
            for held in other.devices:
                if names.canonical(held.device_name) == wanted:
                    yield other, held


def _occupied(cp: Checkpoint, gpu: Gpu, inventory: Inventory, pending: Sequence[DynamicMig]) -> list[PlacedProfile]:
    """The GPU's GPU instances: those NVML listed, and those claims created or plan to create (the inventory
    may lag behind them)."""
    taken: dict[tuple[int, int], int] = {}  # (profile id, start) -> memory slices
    for gi in gpu.gpu_instances:
        taken[gi.gi_profile_id, gi.placement.start] = gi.placement.size
    for mig in inventory.mig_devices_of(gpu.minor):
        taken[mig.gi_profile_id, mig.placement.start] = mig.placement.size
    plans = [d.dynamic_mig for e in cp.claims.values() for d in e.devices if d.dynamic_mig] + list(pending)
    for plan in plans:
        if plan.parent_uuid == gpu.uuid and (profile := gpu.profile(plan.gi_profile_id)) is not None:
            taken[plan.gi_profile_id, plan.start] = profile.memory_slices
    placed = []
    for (profile_id, start), size in taken.items():
        profile = gpu.profile(profile_id)
        # An instance of a profile the GPU does not list cannot be checked: it makes every placement invalid.
        name, slices = (profile.name, profile.compute_slices) if profile else (f"unknown-{profile_id}", 0)
        placed.append(PlacedProfile(start, size, name, profile_id, slices))
    return placed


def holders(cp: Checkpoint) -> list[tuple[str, str]]:
    """(device, "namespace/name" of its claim) for every device a claim in the checkpoint holds (prepared, or
    being prepared), and those fenced records hold ("fenced claim <uid>")."""
    held = [(d.device_name, f"{e.namespace}/{e.name}") for e in cp.claims.values() for d in e.devices]
    return held + [(d, f"fenced claim {f.uid}") for f in cp.fenced.values() for d in f.devices]
