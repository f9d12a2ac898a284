"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

A candidate takes the Lease when it is free or its holder has not renewed it for `lease_duration`; the
leader renews every `retry_period` and gives up leading when it could not renew for `renew_deadline`
(then the process should exit and start over: its caches may be behind a newer leader's writes). Every
write carries the Lease's resourceVersion, so two candidates never both win.

`check_leading` is the leader's write gate: it refuses once the last renewal is older than `renew_deadline`
on the monotonic clock, which runs on while the process is paused (SIGSTOP, a stalled VM). A standby takes
the Lease only `lease_duration` after it last saw the record change, later than that, so a leader that
resumes after losing the Lease writes nothing: its first write finds the deadline passed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound, NotLeading
from agent.kube.rest import LEASES, Rest
from agent.times import rfc3339

log = logging.getLogger(__name__)


def check_timings(lease_duration: float, renew_deadline: float, retry_period: float) -> None:
    """ValueError unless 0 < retry_period < renew_deadline < lease_duration (client-go's rule): the leader
    must try again before its deadline, and stop writing before a standby may take the Lease."""
    if not 0 < retry_period < renew_deadline < lease_duration or not math.isfinite(lease_duration):
        raise ValueError(
            f"leader election needs 0 < retry period ({retry_period:g} s) < renew deadline "
            f"({renew_deadline:g} s) < lease duration ({lease_duration:g} s)"
        )


class HolderClock:
    """client-go's rule for a Lease someone else may hold: its holder holds it while its record (holder and
    renewTime) last changed within leaseDurationSeconds, by our clock: the holder's clock is not ours."""

    def __init__(self) -> None:
        self._record, self._since = "", 0.0  # holder@renewTime as last read, and when (our clock) it changed

    def holding(self, spec: Mapping[str, Any], now: float, default_duration: float = 15.0) -> str | None:
        """The holder, while it holds the Lease as read now (`spec`); None when it is free or has lapsed."""
        holder = str(spec.get("holderIdentity") or "")
        record = f"{holder}@{spec.get('renewTime') or ''}"
        if record != self._record:
            self._record, self._since = record, now  # the record changed: its holder is alive, as of now
        duration = float(spec.get("leaseDurationSeconds") or default_duration)
        return holder if holder and now < self._since + duration else None


class LeaderElector:
    def __init__(
        self,
        rest: Rest,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = 15.0,
        renew_deadline: float = 10.0,
        retry_period: float = 2.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        check_timings(lease_duration, renew_deadline, retry_period)
        self._rest = rest
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._clock = clock
        self._monotonic = monotonic
        self.leading = threading.Event()
        self.lost = threading.Event()
        self._renewed_at: float | None = None  # monotonic time an attempt that renewed started
        self._holder = HolderClock()

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True while we hold the Lease."""
        now = self._clock()
        try:
            lease: Json | None = self._rest.get(LEASES, self.namespace, self.name)
        except NotFound:
            lease = None
        # rounded up: a standby waits at least as long as this leader keeps writing
        stamp = rfc3339(now, 6)  # metav1.MicroTime
        spec = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": math.ceil(self.lease_duration),
            "acquireTime": stamp,
            "renewTime": stamp,
            "leaseTransitions": 0,
        }
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": spec,
            }
            try:
                self._rest.create(LEASES, self.namespace, body)
            except Conflict:
                return False
            return True
        old = lease.get("spec") or {}
        holder = str(old.get("holderIdentity") or "")
        if self._holder.holding(old, now, self.lease_duration) not in (None, self.identity):
            return False  # someone else holds it and renewed within the lease duration (by our clock)
        if holder == self.identity:
            spec["acquireTime"] = old.get("acquireTime") or spec["acquireTime"]
            spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0)
        else:
            spec["leaseTransitions"] = int(old.get("leaseTransitions") or 0) + 1
        lease["spec"] = {**old, **spec}
        try:
            self._rest.replace(LEASES, lease)
        except Conflict:
            return False
        return True

    def lead(self, stop: threading.Event) -> bool:
        """Campaign in a thread of its own: True once leading, False if `stop` came first. From then on a lost
        Lease sets `stop`, so the process winds down (and exits, to come back as a standby)."""
        threading.Thread(target=self.run, args=(stop,), name="leader-election", daemon=True).start()
        while not self.leading.wait(0.5):
            if stop.is_set():
                return False

        def stop_when_lost() -> None:
            self.lost.wait()
            stop.set()

        threading.Thread(target=stop_when_lost, name="lease-lost", daemon=True).start()
        return True

    def run(self, stop: threading.Event) -> None:
        """Campaign until leading, then keep renewing; sets `leading`, and `lost` when a renewal deadline
        passes. Returns when `stop` is set or leadership is lost."""
        while not stop.is_set() and not self.lost.is_set():
            started = self._monotonic()  # before the request: the Lease says renewed no later than this
            try:
                ok = self.try_acquire_or_renew()
            except ApiError as exc:
                log.warning("leader election: %s", exc)
                ok = False
            if ok and self._expired(started):
                ok = False  # paused past the deadline inside the attempt: a standby may have led meanwhile
            if ok:
                self._renewed_at = started
                if not self.leading.is_set():
                    log.info(
                        "became leader", extra={"lease": f"{self.namespace}/{self.name}", "identity": self.identity}
                    )
                    self.leading.set()
            elif self.leading.is_set() and self._expired(self._renewed_at):
                self._lose()
                return
            stop.wait(self.retry_period)

    def _expired(self, renewed_at: float | None) -> bool:
        return renewed_at is None or self._monotonic() - renewed_at >= self.renew_deadline

    def _lose(self) -> None:
        if not self.lost.is_set():
            log.error("lost the lease %s/%s: not renewed for %gs", self.namespace, self.name, self.renew_deadline)
        self.leading.clear()
        self.lost.set()

    def check_leading(self) -> None:
        """The write gate: returns while this process leads and renewed within `renew_deadline` (client-go's
        rule), else raises NotLeading (and from then on this elector has lost: the process should exit)."""
        if self.leading.is_set() and not self.lost.is_set() and not self._expired(self._renewed_at):
            return
        if self.leading.is_set():
            self._lose()
        raise NotLeading(
            0,
            f"not writing: {self.identity} does not hold the Lease {self.namespace}/{self.name} "
            f"(last renewed over {self.renew_deadline:g} s ago, or never)",
        )

    def release(self) -> None:
        """On a clean shutdown: empty the holder so a standby takes over at once, not after lease_duration."""
        try:
            lease = self._rest.get(LEASES, self.namespace, self.name)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                lease["spec"]["leaseDurationSeconds"] = 1
                self._rest.replace(LEASES, lease)
        except ApiError as exc:
            log.warning("could not release the lease: %s", exc)
