"""Applying, undoing and adopting a claim's sharing, crash-safely.

Before it changes anything on a GPU, `apply` saves the claim's plan as a record
(`<state dir>/sharing/<claim uid>.json`); `undo` removes the record only after every change is reverted.
So whatever point a kill -9 hits, the record names what may need undoing, and undo is idempotent: the
claim code calls it when it rolls back a PrepareStarted claim, and `reconcile` at startup undoes the
records of claims that are no longer prepared (stopping their MPS daemons) and adopts the daemons of
claims that are, starting again one that died with the node agent's host process.

A GPU's compute mode and time slice go back to DEFAULT only when no other claim's record still needs them
(claims with the same strategy may share a device). Two MPS daemons cannot serve one device (an
EXCLUSIVE_PROCESS GPU admits one MPS server), so a second MPS claim on it is refused: pods share one MPS
daemon by sharing one ResourceClaim.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent import files
from agent.sharing.commands import CommandRunner, SharingError
from agent.sharing.mps import CONTAINER_PIPE_DIRECTORY, MpsDaemons
from agent.sharing.plan import MpsPlan, SharedDevice, SharingConfigError, SharingPlan, plan_sharing
from agent.sharing.smi import ComputeMode, NvidiaSmi

log = logging.getLogger(__name__)

RECORDS = "sharing"
MPS_DIRS = "mps"
SHM = "/dev/shm"  # noqa: S108 (not a temp file:) MPS clients and server meet in shared memory as well as in the pipe directory


@dataclass(frozen=True)
class Adoption:
    """What `reconcile` found at startup, for the log."""

    adopted: tuple[str, ...] = ()  # claims whose MPS daemon was still running
    restarted: tuple[str, ...] = ()  # claims whose MPS daemon had died and was started again
    undone: tuple[str, ...] = ()  # claims no longer prepared: sharing reverted, daemon stopped


class SharingControl:
    """The node side of TimeSlicing and MPS for prepared claims."""

    def __init__(self, runner: CommandRunner, state_dir: Path) -> None:
        self.smi = NvidiaSmi(runner)
        self.mps = MpsDaemons(runner, Path(state_dir) / MPS_DIRS)
        self.records = Path(state_dir) / RECORDS

    # --- prepare ----------------------------------------------------------------------------------------

    def apply(self, claim_uid: str, devices: Sequence[SharedDevice]) -> dict[str, Any] | None:
        """Apply the claim's sharing; returns the CDI container edits its containers need (None: none).

        Raises SharingConfigError (the config cannot work on these devices) or SharingError (a binary
        failed, or the device is served by another claim's MPS daemon). The caller undoes on failure."""
        plan = plan_sharing(devices)
        if plan.empty:
            return None
        if plan.mps is not None:
            self._refuse_second_daemon(claim_uid, plan.mps)
        self._save(claim_uid, plan)  # before any change: a crash from here on leaves the record to undo by
        for gpu, timeslice in plan.timeslices:
            self.smi.set_compute_mode(gpu, ComputeMode.DEFAULT)
            self.smi.set_timeslice(gpu, timeslice)
        if plan.mps is None:
            return None
        for gpu in plan.mps.exclusive_gpus:
            self.smi.set_compute_mode(gpu, ComputeMode.EXCLUSIVE_PROCESS)
        self.mps.start(claim_uid, plan.mps)
        log.info("MPS control daemon serving claim %s", claim_uid,
                 extra={"claim_uid": claim_uid, "devices": list(plan.mps.devices)})  # fmt: skip
        return mps_container_edits(self.mps.dirs(claim_uid).pipe)

    def _refuse_second_daemon(self, claim_uid: str, mps: MpsPlan) -> None:
        for other, plan in self._others(claim_uid):
            if plan.mps is not None and (shared := set(mps.devices) & set(plan.mps.devices)):
                raise SharingError(
                    f"device {sorted(shared)[0]} is already served by the MPS daemon of claim {other}; one MPS "
                    "daemon serves a device: let the pods share that ResourceClaim instead"
                )

    # --- unprepare / rollback ---------------------------------------------------------------------------

    def undo(self, claim_uid: str) -> None:
        """Revert what `apply` did (or may have done) for the claim. Idempotent; no record: nothing to do
        but stop a daemon whose directories are still there. Raises SharingError, keeping the record."""
        plan = self._load(claim_uid)
        if plan is None:
            if claim_uid in self.mps.claim_uids():
                self.mps.stop(claim_uid)
            return
        self.mps.stop(claim_uid)  # first: the GPU leaves EXCLUSIVE_PROCESS only once its MPS server is gone
        others = [p for _, p in self._others(claim_uid)]
        still_exclusive = {g for p in others if p.mps for g in p.mps.exclusive_gpus}
        for gpu in plan.mps.exclusive_gpus if plan.mps else ():
            if gpu not in still_exclusive:
                self.smi.restore(gpu)
        still_sliced = {g for p in others for g, _ in p.timeslices}
        for gpu, _ in plan.timeslices:
            if gpu not in still_sliced:
                self.smi.restore(gpu, timeslice=True)
        files.remove(self._path(claim_uid))

    # --- startup ----------------------------------------------------------------------------------------

    def reconcile(self, prepared: Set[str]) -> Adoption:
        """Undo the sharing of claims not in `prepared`; adopt (or restart) the MPS daemons of those in it.
        A claim whose undo fails is logged and left for the next start; it does not stop this one."""
        adopted, restarted, undone = [], [], []
        for uid in sorted(self._record_uids() | self.mps.claim_uids()):
            try:
                if uid not in prepared:
                    self.undo(uid)
                    undone.append(uid)
                    continue
                plan = self._load(uid)
                if plan is None or plan.mps is None:
                    continue
                if self.mps.running(uid):
                    adopted.append(uid)
                else:
                    log.warning("the MPS control daemon of prepared claim %s is gone: starting it again", uid)
                    for gpu in plan.mps.exclusive_gpus:
                        self.smi.set_compute_mode(gpu, ComputeMode.EXCLUSIVE_PROCESS)
                    self.mps.start(uid, plan.mps)
                    restarted.append(uid)
            except SharingError as exc:
                log.error("sharing of claim %s: %s", uid, exc)  # noqa: TRY400 (the cause is in the message)
        return Adoption(tuple(adopted), tuple(restarted), tuple(undone))

    def mps_running(self, claim_uid: str) -> bool:
        return self.mps.running(claim_uid)

    # --- records ----------------------------------------------------------------------------------------

    def _path(self, claim_uid: str) -> Path:
        return self.records / f"{claim_uid}.json"

    def _save(self, claim_uid: str, plan: SharingPlan) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        # Not durable: a power loss voids every claim, and the GPUs forget their settings with it.
        files.write_atomic(self._path(claim_uid), json.dumps(asdict(plan)).encode(), durable=False)

    def _load(self, claim_uid: str) -> SharingPlan | None:
        try:
            raw = json.loads(self._path(claim_uid).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise SharingError(f"the sharing record of claim {claim_uid} is unreadable: {exc}") from exc
        return _plan_from_json(raw)

    def _record_uids(self) -> set[str]:
        if not self.records.is_dir():
            return set()
        return {p.name[: -len(".json")] for p in self.records.iterdir() if p.name.endswith(".json")}

    def _others(self, claim_uid: str) -> Iterable[tuple[str, SharingPlan]]:
        for uid in sorted(self._record_uids() - {claim_uid}):
            plan = self._load(uid)
            if plan is not None:
                yield uid, plan


def _plan_from_json(raw: Mapping[str, Any]) -> SharingPlan:
    mps = raw.get("mps")
    return SharingPlan(
        timeslices=tuple((str(g), int(t)) for g, t in raw.get("timeslices", ())),
        mps=None if mps is None else MpsPlan(
            devices=tuple(mps["devices"]),
            exclusive_gpus=tuple(mps["exclusive_gpus"]),
            active_thread_percentage=mps.get("active_thread_percentage"),
            pinned_memory_mib=tuple((str(u), int(m)) for u, m in mps.get("pinned_memory_mib", ())),
        ),
    )


def mps_container_edits(pipe_dir: Path) -> dict[str, Any]:
    """What a container of an MPS claim needs: the daemon's pipe directory at NVIDIA's path, and /dev/shm."""
    options = ["rw", "nosuid", "nodev", "bind"]
    return {
        "env": [f"CUDA_MPS_PIPE_DIRECTORY={CONTAINER_PIPE_DIRECTORY}"],
        "mounts": [
            {"hostPath": str(pipe_dir), "containerPath": CONTAINER_PIPE_DIRECTORY, "options": options},
            {"hostPath": SHM, "containerPath": SHM, "options": options},
        ],
    }


def with_container_edits(spec: Mapping[str, Any], edits: Mapping[str, Any]) -> dict[str, Any]:
    """`spec` with `edits` added to its claim-wide containerEdits (a new dict; `spec` is left alone)."""
    common = dict(spec.get("containerEdits") or {})
    for key, values in edits.items():
        common[key] = [*common.get(key, ()), *values]
    return {**spec, "containerEdits": common}


__all__ = ["Adoption", "SharingConfigError", "SharingControl", "SharingError", "mps_container_edits",
           "with_container_edits"]
