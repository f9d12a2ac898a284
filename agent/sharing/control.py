"""Applying, undoing and adopting a claim's sharing, crash-safely.

Before it changes anything on a GPU, `apply` saves the claim's plan as a record
(`<state dir>/sharing/<claim uid>.json`), and before each change the step it begins; a step whose binary
was missing or refused is taken off again, so undoing a prepare that failed needs nothing that failed it.
`undo` takes each step off once reverted and removes the record after the last one. So whatever point a
kill -9 hits, the record names what may need undoing, and undo is idempotent: the
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
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from agent import files
from agent.sharing.commands import CommandFailed, CommandRunner, NotRun, SharingError
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
        failed, or the device is served by another claim's MPS daemon). The caller undoes on failure, and
        the record names only the changes that may have been made: a step whose binary was missing or
        refused changed nothing, so undoing it needs no binary."""
        plan = plan_sharing(devices)
        if plan.empty:
            return None
        if plan.mps is not None:
            self._refuse_second_daemon(claim_uid, plan.mps)
        begun: list[str] = []
        self._save(claim_uid, plan, begun)  # before any change: a crash from here on leaves the record to undo by
        for gpu, timeslice in plan.timeslices:
            self.smi.set_compute_mode(gpu, ComputeMode.DEFAULT)  # the mode undo returns to: nothing to record
            self._step(claim_uid, plan, begun, _timeslice(gpu), partial(self.smi.set_timeslice, gpu, timeslice))
        if plan.mps is None:
            return None
        mps = plan.mps
        for gpu in mps.exclusive_gpus:
            self._step(
                claim_uid,
                plan,
                begun,
                _exclusive(gpu),
                partial(self.smi.set_compute_mode, gpu, ComputeMode.EXCLUSIVE_PROCESS),
            )
        self._step(claim_uid, plan, begun, DAEMON, partial(self.mps.launch, claim_uid, mps))
        self.mps.set_limits(claim_uid, mps)
        log.info(
            "MPS control daemon serving claim %s",
            claim_uid,
            extra={"claim_uid": claim_uid, "devices": list(mps.devices)},
        )
        return mps_container_edits(self.mps.dirs(claim_uid).pipe)

    def _step(self, claim_uid: str, plan: SharingPlan, begun: list[str], step: str, change: Callable[[], None]) -> None:
        """Record `step` as begun, then make the change; a change that surely did not happen (the binary was
        missing, or it refused) is taken off the record again before the error goes on."""
        begun.append(step)
        self._save(claim_uid, plan, begun)
        try:
            change()
        except (NotRun, CommandFailed):
            begun.remove(step)
            self._save(claim_uid, plan, begun)
            raise

    def _refuse_second_daemon(self, claim_uid: str, mps: MpsPlan) -> None:
        for other, plan in self._others(claim_uid):
            if plan.mps is not None and (shared := set(mps.devices) & set(plan.mps.devices)):
                raise SharingError(
                    f"device {sorted(shared)[0]} is already served by the MPS daemon of claim {other}; one MPS "
                    "daemon serves a device: let the pods share that ResourceClaim instead"
                )

    # --- unprepare / rollback ---------------------------------------------------------------------------

    def undo(self, claim_uid: str) -> None:
        """Revert what `apply` did (or may have done) for the claim: the steps its record names as begun.
        Idempotent, and each step is taken off the record once reverted; no record: nothing to do but stop a
        daemon whose directories are still there. Raises SharingError, keeping the record."""
        loaded = self._load(claim_uid)
        if loaded is None:
            if claim_uid in self.mps.claim_uids():
                self.mps.stop(claim_uid)
            return
        plan, begun = loaded
        # The daemon first: the GPU leaves EXCLUSIVE_PROCESS only once its MPS server is gone. Directories
        # without a recorded start (a crash inside it) are stopped too.
        if DAEMON in begun or claim_uid in self.mps.claim_uids():
            self.mps.stop(claim_uid)
            self._done(claim_uid, plan, begun, DAEMON)
        others = [p for _, p in self._others(claim_uid)]
        still_exclusive = {g for p in others if p.mps for g in p.mps.exclusive_gpus}
        for gpu in plan.mps.exclusive_gpus if plan.mps else ():
            if _exclusive(gpu) in begun:
                if gpu not in still_exclusive:
                    self.smi.restore(gpu)
                self._done(claim_uid, plan, begun, _exclusive(gpu))
        still_sliced = {g for p in others for g, _ in p.timeslices}
        for gpu, _ in plan.timeslices:
            if _timeslice(gpu) in begun:
                if gpu not in still_sliced:
                    self.smi.restore_timeslice(gpu)
                self._done(claim_uid, plan, begun, _timeslice(gpu))
        files.remove(self._path(claim_uid))

    def _done(self, claim_uid: str, plan: SharingPlan, begun: list[str], step: str) -> None:
        if step in begun:
            begun.remove(step)
            self._save(claim_uid, plan, begun)

    # --- startup ----------------------------------------------------------------------------------------

    def reconcile(self, prepared: Set[str]) -> Adoption:
        """Undo the sharing of claims not in `prepared`; adopt (or restart) the MPS daemons of those in it.
        A claim whose undo fails is logged and left for the next start; it does not stop this one."""
        adopted: list[str] = []
        restarted: list[str] = []
        undone: list[str] = []
        for uid in sorted(self._record_uids() | self.mps.claim_uids()):
            try:
                if uid not in prepared:
                    self.undo(uid)
                    undone.append(uid)
                    continue
                revived = self.revive(uid)
                if revived is not None:
                    (restarted if revived else adopted).append(uid)
            except SharingError as exc:
                log.error("sharing of claim %s: %s", uid, exc)  # noqa: TRY400 (the cause is in the message)
        return Adoption(tuple(adopted), tuple(restarted), tuple(undone))

    def revive(self, claim_uid: str) -> bool | None:
        """Start the MPS daemon of a prepared claim again if it is gone (its GPUs back in EXCLUSIVE_PROCESS,
        its limits set again). True: started again; False: it is alive; None: the claim has no daemon.
        Raises SharingError."""
        loaded = self._load(claim_uid)
        mps = loaded[0].mps if loaded is not None else None
        if mps is None:
            return None
        if self.mps.running(claim_uid):
            return False
        log.warning("the MPS control daemon of prepared claim %s is gone: starting it again", claim_uid)
        for gpu in mps.exclusive_gpus:
            self.smi.set_compute_mode(gpu, ComputeMode.EXCLUSIVE_PROCESS)
        self.mps.start(claim_uid, mps)
        return True

    def daemon_pids(self) -> dict[str, int | None]:
        """The MPS daemons of claims with a record, by claim uid: the pid each wrote (None: none written)."""
        out: dict[str, int | None] = {}
        for uid in sorted(self._record_uids()):
            loaded = self._load(uid)
            if loaded is not None and loaded[0].mps is not None:
                out[uid] = self.mps.pid(uid)
        return out

    # --- records ----------------------------------------------------------------------------------------

    def _path(self, claim_uid: str) -> Path:
        return self.records / f"{claim_uid}.json"

    def _save(self, claim_uid: str, plan: SharingPlan, begun: Sequence[str]) -> None:
        self.records.mkdir(parents=True, exist_ok=True)
        # Not durable: a power loss voids every claim, and the GPUs forget their settings with it.
        record = asdict(plan) | {"begun": list(begun)}
        files.write_atomic(self._path(claim_uid), json.dumps(record).encode(), durable=False)

    def _load(self, claim_uid: str) -> tuple[SharingPlan, list[str]] | None:
        """The claim's plan and the steps begun (a record without that list, from an older agent: every step)."""
        try:
            raw = json.loads(self._path(claim_uid).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise SharingError(f"the sharing record of claim {claim_uid} is unreadable: {exc}") from exc
        plan = _plan_from_json(raw)
        begun = raw.get("begun")
        return plan, [str(s) for s in begun] if isinstance(begun, list) else _all_steps(plan)

    def _record_uids(self) -> set[str]:
        if not self.records.is_dir():
            return set()
        return {p.name[: -len(".json")] for p in self.records.iterdir() if p.name.endswith(".json")}

    def _others(self, claim_uid: str) -> Iterable[tuple[str, SharingPlan]]:
        for uid in sorted(self._record_uids() - {claim_uid}):
            loaded = self._load(uid)
            if loaded is not None:
                yield uid, loaded[0]


DAEMON = "mps-daemon"


def _timeslice(gpu: str) -> str:
    return f"timeslice:{gpu}"


def _exclusive(gpu: str) -> str:
    return f"exclusive-process:{gpu}"


def _all_steps(plan: SharingPlan) -> list[str]:
    steps = [_timeslice(g) for g, _ in plan.timeslices]
    if plan.mps is not None:
        steps += [_exclusive(g) for g in plan.mps.exclusive_gpus] + [DAEMON]
    return steps


def _plan_from_json(raw: Mapping[str, Any]) -> SharingPlan:
    mps = raw.get("mps")
    return SharingPlan(
        timeslices=tuple((str(g), int(t)) for g, t in raw.get("timeslices", ())),
        mps=None
        if mps is None
        else MpsPlan(
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


def with_device_edits(spec: Mapping[str, Any], devices: Set[str], edits: Mapping[str, Any]) -> dict[str, Any]:
    """`spec` with `edits` added to the containerEdits of the CDI devices named `devices` only (a new dict; `spec`
    is left alone): a container is given them only with those devices, so the containers of a claim's other
    requests never see another request's MPS pipe (as NVIDIA's CreateClaimSpecFile attaches them)."""
    out = []
    for device in spec.get("devices") or ():
        if device.get("name") not in devices:
            out.append(device)
            continue
        own = dict(device.get("containerEdits") or {})
        for key, values in edits.items():
            own[key] = [*own.get(key, ()), *values]
        out.append({**device, "containerEdits": own})
    return {**spec, "devices": out}


__all__ = [
    "Adoption",
    "SharingConfigError",
    "SharingControl",
    "SharingError",
    "mps_container_edits",
    "with_device_edits",
]
