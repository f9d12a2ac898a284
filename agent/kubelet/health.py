"""Device health as the node agent knows it, broadcast to every open NodeWatchResources stream."""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass


class Health(enum.Enum):
    """Values match the v1alpha1 HealthStatus enum on the wire."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


@dataclass(frozen=True)
class DeviceHealth:
    pool: str
    device: str
    health: Health
    last_updated: int  # unix seconds, when the agent last determined this health
    message: str = ""  # why, for people (sent on the v1 stream)


@dataclass(frozen=True)
class HealthSnapshot:
    """The full device list at one version; versions only grow, so a watcher can tell what it has seen."""

    version: int
    devices: tuple[DeviceHealth, ...]


class HealthSource:
    """A thread-safe store of device health that wakes watchers on every change.

    The node agent calls `set`/`replace`; each stream calls `wait_newer` in a loop. Watchers never miss the
    latest state (they may skip intermediate ones, which is fine: every message is the full list).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._devices: dict[tuple[str, str], DeviceHealth] = {}
        self._version = 0

    def set(self, pool: str, device: str, health: Health, now: int, message: str = "") -> None:
        """Record one device's health; a report identical to the stored one is not a change."""
        entry = DeviceHealth(pool, device, health, now, message)
        with self._changed:
            old = self._devices.get((pool, device))
            if old is not None and old.health == health:
                return
            self._devices[(pool, device)] = entry
            self._bump()

    def replace(self, devices: Iterable[DeviceHealth]) -> None:
        """Replace the whole list (e.g. after discovery); devices not given are forgotten."""
        fresh = {(d.pool, d.device): d for d in devices}
        with self._changed:
            if fresh == self._devices:
                return
            self._devices = fresh
            self._bump()

    def snapshot(self) -> HealthSnapshot:
        with self._changed:
            return self._snapshot()

    def wait_newer(
        self, seen_version: int, timeout: float | None = None, stop: Callable[[], bool] = lambda: False
    ) -> HealthSnapshot | None:
        """The current snapshot once its version exceeds seen_version; None on timeout or once stop() holds.

        Whoever makes stop() true must call wake_all() so the waiter notices at once.
        """
        with self._changed:
            self._changed.wait_for(lambda: stop() or self._version > seen_version, timeout)
            if stop() or self._version <= seen_version:
                return None
            return self._snapshot()

    def wake_all(self) -> None:
        """Wake every waiter so it re-checks its stop condition (e.g. its stream was cancelled)."""
        with self._changed:
            self._changed.notify_all()

    def _bump(self) -> None:
        self._version += 1
        self._changed.notify_all()

    def _snapshot(self) -> HealthSnapshot:
        ordered = sorted(self._devices.values(), key=lambda d: (d.pool, d.device))
        return HealthSnapshot(self._version, tuple(ordered))
