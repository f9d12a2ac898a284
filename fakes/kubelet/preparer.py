"""An in-memory Preparer for kubelet-plugin tests, benchmarks and demos: no API server, no CDI files."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from agent.claims import cdi
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.devices.names import gpu_device_name


class InMemoryPreparer:
    """Gives each claim `devices_per_claim` GPUs of `pool`, idempotently; `fail` maps uid -> error to report.

    `raises` makes every call raise it (a misbehaving driver); `delay` holds each call, and `max_active`
    records the most calls ever in flight at once, to observe serialization.
    """

    def __init__(
        self,
        pool: str = "node-a",
        devices_per_claim: int = 1,
        fail: dict[str, str] | None = None,
        raises: Exception | None = None,
        delay: float = 0.0,
    ) -> None:
        self.pool = pool
        self.devices_per_claim = devices_per_claim
        self.fail = dict(fail or {})
        self.raises = raises
        self.delay = delay
        self.prepared: dict[str, PrepareResult] = {}
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.max_active = 0
        self._active = 0
        self._lock = threading.Lock()

    def prepare(self, claims: Sequence[ClaimRef], timeout: float | None = None) -> dict[str, PrepareResult]:
        with self._call("prepare", claims):
            results = {}
            for claim in claims:
                if claim.uid in self.fail:
                    results[claim.uid] = PrepareResult(error=self.fail[claim.uid])
                    continue
                if claim.uid not in self.prepared:
                    self.prepared[claim.uid] = PrepareResult(devices=self._devices(claim.uid))
                results[claim.uid] = self.prepared[claim.uid]
            return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        with self._call("unprepare", claims):
            for claim in claims:
                self.prepared.pop(claim.uid, None)
            return {claim.uid: self.fail.get(claim.uid, "") for claim in claims}

    def _devices(self, uid: str) -> tuple[PreparedDevice, ...]:
        offset = len(self.prepared) * self.devices_per_claim
        names = [gpu_device_name(offset + i) for i in range(self.devices_per_claim)]
        return tuple(
            PreparedDevice(
                request_names=("gpu",),
                pool_name=self.pool,
                device_name=name,
                cdi_device_ids=(cdi.device_id(uid, name),),
            )
            for name in names
        )

    @contextmanager
    def _call(self, action: str, claims: Sequence[ClaimRef]) -> Iterator[None]:
        with self._lock:
            self.calls.append((action, tuple(c.uid for c in claims)))
            self._active += 1
            self.max_active = max(self.max_active, self._active)
        try:
            if self.delay:
                time.sleep(self.delay)
            if self.raises is not None:
                raise self.raises
            yield
        finally:
            with self._lock:
                self._active -= 1
