"""Leader election on a coordination.k8s.io/v1 Lease, as client-go's leaderelection does it.

A candidate takes the Lease when it is free or its holder has not renewed it for `lease_duration`; the
leader renews every `retry_period` and gives up leading when it could not renew for `renew_deadline`
(then the process should exit and start over: its caches may be behind a newer leader's writes). Every
write carries the Lease's resourceVersion, so two candidates never both win.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.rest import LEASES, Json, Rest

log = logging.getLogger(__name__)


def _micro_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_time(text: str | None) -> float:
    if not text:
        return 0.0
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class LeaderElector:
    def __init__(self, rest: Rest, namespace: str, name: str, identity: str, *, lease_duration: float = 15.0,
                 renew_deadline: float = 10.0, retry_period: float = 2.0,
                 clock: Callable[[], float] = time.time) -> None:
        self._rest = rest
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self._clock = clock
        self.leading = threading.Event()
        self.lost = threading.Event()
        self._observed: tuple[str, float] = ("", 0.0)  # (holder@renewTime as last read, when it last changed)

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True while we hold the Lease."""
        now = self._clock()
        try:
            lease: Json | None = self._rest.get(LEASES, self.namespace, self.name)
        except NotFound:
            lease = None
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration),
                "acquireTime": _micro_time(now), "renewTime": _micro_time(now), "leaseTransitions": 0}
        if lease is None:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": spec}
            try:
                self._rest.create(LEASES, self.namespace, body)
            except Conflict:
                return False
            return True
        old = lease.get("spec") or {}
        holder = str(old.get("holderIdentity") or "")
        record = f"{holder}@{old.get('renewTime') or ''}"
        if record != self._observed[0]:
            self._observed = (record, now)  # the record changed: its holder is alive, as of now by our clock
        duration = float(old.get("leaseDurationSeconds") or self.lease_duration)
        if holder and holder != self.identity and now < self._observed[1] + duration:
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


    def run(self, stop: threading.Event) -> None:
        """Campaign until leading, then keep renewing; sets `leading`, and `lost` when a renewal deadline
        passes. Returns when `stop` is set or leadership is lost."""
        last_renew = 0.0
        while not stop.is_set():
            try:
                ok = self.try_acquire_or_renew()
            except ApiError as exc:
                log.warning("leader election: %s", exc)
                ok = False
            now = self._clock()
            if ok:
                last_renew = now
                if not self.leading.is_set():
                    log.info("became leader", extra={"lease": f"{self.namespace}/{self.name}",
                                                      "identity": self.identity})
                    self.leading.set()
            elif self.leading.is_set() and now - last_renew > self.renew_deadline:
                log.error("lost the lease %s/%s: could not renew for %.0fs", self.namespace, self.name,
                          self.renew_deadline)
                self.leading.clear()
                self.lost.set()
                return
            stop.wait(self.retry_period)

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
