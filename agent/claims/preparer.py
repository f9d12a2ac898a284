"""ClaimPreparer: the agent.claims.types.Preparer the kubelet plugin calls.

It serialises batches with the node lock, taken only after the batch's claims are read from the API (all at
once, within the call's deadline): the lock guards local state, not the network. Each claim's failure stays
in that claim's result (a bad claim, an API error, an unexpected exception, its own record fenced); only a
failure of the node's own claim state (lock timeout, unusable state dir) fails the whole batch, since no claim
could be recorded then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.claims.cdi import CdiStore
from agent.claims.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    CheckpointStore,
    ClaimState,
    FencedRecord,
    read_boot_id,
)
from agent.claims.claim import ClaimError
from agent.claims.lock import LOCK_FILE, LockTimeout, NodeLock
from agent.claims.settings import PrepareSettings
from agent.claims.source import ClaimSource, read_claims
from agent.claims.state import ClaimStates, Recovery, holders
from agent.claims.types import ClaimRef, Notify, PrepareResult, log_refusal

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Revival:
    """An MPS daemon of a prepared claim found dead, and whether it runs again."""

    namespace: str
    name: str
    uid: str
    old_pid: int | None
    new_pid: int | None
    error: str = ""  # why it could not be started again


class ClaimPreparer:
    def __init__(
        self,
        settings: PrepareSettings,
        *,
        state_dir: Path,
        cdi_root: Path,
        source: ClaimSource,
        driver_edits: Mapping[str, Any] | None = None,  # the driver's files and hooks, in every claim's spec
        boot_id: Callable[[], str] = read_boot_id,
        lock_timeout: float = 10.0,
        notify: Notify = lambda claim, type_, reason, message: None,
        on_fenced: Callable[[int], None] = lambda count: None,
    ) -> None:
        """`settings`: what prepare needs of the node (ClaimStates takes it). `notify` tells people what they
        should know of a prepared claim, and of a fenced claim record (agent.claims.checkpoint), once each
        (agent.node makes Events of it); `on_fenced` gets the number of fenced records after each read (a
        metric)."""
        state_dir = Path(state_dir)
        state_dir.mkdir(parents=True, exist_ok=True)
        self.lock = NodeLock(state_dir / LOCK_FILE, timeout=lock_timeout)
        self.source = source
        self.notify = notify
        self.on_fenced = on_fenced
        self._told: set[FencedRecord] = set()  # fenced records already told of
        self.states = ClaimStates(
            settings, checkpoints=CheckpointStore(state_dir, boot_id), specs=CdiStore(cdi_root, driver_edits)
        )

    def recover(self) -> Recovery:
        """Run once at startup, before serving the kubelet. Raises CheckpointCorrupt / LockTimeout."""
        with self.lock.hold():
            recovery = self.states.recover()
            self._report_fenced(self.states.load())
        if recovery != Recovery():
            log.info("claim state repaired: %s", recovery)
        return recovery

    def prepare(self, claims: Sequence[ClaimRef], timeout: float | None = None) -> dict[str, PrepareResult]:
        """Claims are read from the API first, all at once and within `timeout` (the gRPC call's deadline),
        without the node lock: the lock guards local state, and an unprepare must never wait on the API."""
        started = time.monotonic()
        results: dict[str, PrepareResult] = {}
        deadline = None if timeout is None else started + timeout
        unread = [ref for ref in claims if not self.states.checkpoints.completed_hint(ref.uid)]
        fetched = read_claims(self.source, unread, timeout)
        if claims:
            try:
                lock_wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                with self.lock.hold(lock_wait):
                    cp = self.states.load()
                    self._report_fenced(cp)
                    results |= self.states.prepare(cp, claims, fetched)
            except Exception as exc:
                # The node's claim state is unusable (lock, checkpoint or state dir): every claim fails alike.
                if not isinstance(exc, CheckpointCorrupt | LockTimeout | OSError):
                    log.exception("prepare batch failed")
                results |= {ref.uid: PrepareResult(error=f"cannot prepare: {exc}") for ref in claims}
        elapsed = time.monotonic() - started
        _log_refused("prepare", claims, {uid: r.error for uid, r in results.items()}, elapsed)
        for ref in claims:
            result = results[ref.uid]
            if not result.error:
                _log_done("prepared", ref, [d.device_name for d in result.devices], elapsed)
                for reason, message in result.notices:
                    self.notify(ref, "Normal", reason, message)
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        started = time.monotonic()
        errors: dict[str, str] = {}
        held: dict[str, list[str]] = {}  # the devices each claim held, for the log
        if claims:
            try:
                with self.lock.hold():
                    cp = self.states.load()
                    self._report_fenced(cp)
                    held = {r.uid: [d.device_name for d in e.devices] for r in claims if (e := cp.claims.get(r.uid))}
                    errors |= self.states.unprepare(cp, [ref.uid for ref in claims])
            except Exception as exc:
                if not isinstance(exc, CheckpointCorrupt | LockTimeout | OSError):
                    log.exception("unprepare batch failed")
                errors |= {ref.uid: f"cannot unprepare: {exc}" for ref in claims}
        elapsed = time.monotonic() - started
        _log_refused("unprepare", claims, errors, elapsed)
        for ref in claims:
            if not errors.get(ref.uid):
                _log_done("unprepared", ref, held.get(ref.uid, []), elapsed)
        return errors

    def _report_fenced(self, cp: Checkpoint) -> None:
        """The fenced records in the metric, and a Warning Event on the Node for each one not told of yet."""
        self.on_fenced(len(cp.fenced))
        self._told &= set(cp.fenced.values())  # one moved aside and damaged again is told again
        for record in cp.fenced.values():
            if record not in self._told:
                self._told.add(record)
                log.error("claim %s fenced: %s", record.uid, record.describe(), extra={"claim_uid": record.uid})
                self.notify(
                    None,
                    "Warning",
                    "ClaimRecordFenced",
                    f"{record.describe()}; its claim is fenced, its devices held, other claims go on",
                )

    def revive_dead_daemons(self) -> list[Revival]:
        """Start again the MPS daemons of prepared claims whose process is gone (the watch calls this often:
        without a dead daemon it only reads a few files and takes no lock)."""
        sharing = self.states.sharing
        dead = sharing.dead_daemons() if sharing is not None else {}
        if sharing is None or not dead:
            return []
        out = []
        with self.lock.hold():  # an unprepare stopping the daemon meanwhile must not see it started again
            cp = self.states.load()
            for uid in dead:
                entry = cp.claims.get(uid)
                if entry is None or entry.state is not ClaimState.COMPLETED:
                    continue  # being prepared or unprepared: not ours to start
                pid = sharing.daemon_pid(uid)  # read again: a prepare may have run while we waited for the lock
                try:
                    if sharing.revive(uid):
                        out.append(Revival(entry.namespace, entry.name, uid, pid, sharing.daemon_pid(uid)))
                except ClaimError as exc:
                    out.append(Revival(entry.namespace, entry.name, uid, pid, None, str(exc)))
        return out

    def holders(self) -> list[tuple[str, str]]:
        """(device, "namespace/name" of its claim) for every device of a claim prepared here (the arbiter's
        reservations count them as used)."""
        with self.lock.hold():
            return holders(self.states.load())


def _log_refused(action: str, claims: Sequence[ClaimRef], errors: Mapping[str, str], elapsed: float) -> None:
    """One warning per claim that failed, with its reason (the kubelet shows it too, but only on the pod)."""
    for ref in claims:
        if error := errors.get(ref.uid):
            log_refusal(log, action, ref, error, elapsed)


def _log_done(action: str, ref: ClaimRef, devices: Sequence[str], elapsed: float) -> None:
    """One line per claim prepared or unprepared: which claim, which devices, how long its call took."""
    ms = round(elapsed * 1000, 1)
    fields = {
        "claim_uid": ref.uid,
        "claim_namespace": ref.namespace,
        "claim_name": ref.name,
        "devices": list(devices),
        "ms": ms,
    }
    log.info(
        "%s claim %s/%s (uid %s): %s in %.1f ms",
        action,
        ref.namespace,
        ref.name,
        ref.uid,
        ", ".join(devices) or "no devices",
        ms,
        extra=fields,
    )
