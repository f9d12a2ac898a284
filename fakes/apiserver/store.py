"""Object storage with a global resourceVersion counter and a bounded history of watch events."""

from __future__ import annotations

import copy
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

from .errors import expired
from .resources import Registry

TypeKey = tuple[str, str, str]


@dataclass(frozen=True)
class Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    key: TypeKey
    obj: dict[str, Any]
    old: dict[str, Any] | None  # the previous state, so watches with selectors can turn changes into ADDED/DELETED


def namespace_of(obj: dict[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("namespace") or "")


class Store:
    """All served objects. Callers hold `lock` around read-modify-write sequences; watchers wait on it."""

    def __init__(self, registry: Registry, history: int = 1000) -> None:
        self.registry = registry
        self.lock = threading.Condition(threading.RLock())
        self.history = history
        self._rv = 0
        self._data: dict[TypeKey, dict[tuple[str, str], dict[str, Any]]] = {}
        self._events: deque[Event] = deque()
        self._compacted = 0  # events with rv <= this are gone

    @property
    def resource_version(self) -> int:
        return self._rv

    def read(self, key: TypeKey, namespace: str, name: str) -> dict[str, Any] | None:
        """The stored object itself: callers copy before changing it."""
        return self._data.get(key, {}).get((namespace, name))

    def items(self, key: TypeKey, namespace: str | None = None) -> list[dict[str, Any]]:
        found = self._data.get(key, {})
        return [o for (ns, _), o in sorted(found.items()) if namespace is None or ns == namespace]

    def write(self, key: TypeKey, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        """Store obj (ADDED without old, MODIFIED with) under a new resourceVersion; returns a copy."""
        with self.lock:
            stored = self._stamp(obj)
            meta = stored["metadata"]
            self._data.setdefault(key, {})[(namespace_of(stored), meta["name"])] = stored
            self._record(Event(self._rv, "MODIFIED" if old else "ADDED", key, stored, old))
            return copy.deepcopy(stored)

    def remove(self, key: TypeKey, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            stored = self._stamp(obj)
            self._data.get(key, {}).pop((namespace_of(stored), stored["metadata"]["name"]), None)
            self._record(Event(self._rv, "DELETED", key, stored, None))
            return copy.deepcopy(stored)

    def drop_type(self, key: TypeKey) -> None:
        with self.lock:
            for obj in list(self._data.get(key, {}).values()):
                self.remove(key, obj)
            self._data.pop(key, None)

    def events_after(self, rv: int) -> list[Event]:
        """Events newer than rv; 410 Expired when some of them fell out of the history window."""
        with self.lock:
            if rv < self._compacted:
                raise expired(f"too old resource version: {rv} ({self._compacted + 1})")
            return [e for e in self._events if e.rv > rv]

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._rv += 1
        stored = copy.deepcopy(obj)
        stored.setdefault("metadata", {})["resourceVersion"] = str(self._rv)
        return stored

    def _record(self, event: Event) -> None:
        self._events.append(event)
        while len(self._events) > self.history:
            self._compacted = self._events.popleft().rv
        self.lock.notify_all()

    # Direct access for tests.

    def get(self, kind: str, name: str, namespace: str = "") -> dict[str, Any] | None:
        """A copy of one object by kind or plural ('ResourceSlice', 'pods'), or None."""
        rt = self.registry.find(kind)
        with self.lock:
            found = self.read(rt.key, namespace if rt.namespaced else "", name)
            return copy.deepcopy(found) if found is not None else None

    def objects(self, kind: str, namespace: str | None = None) -> list[dict[str, Any]]:
        """Copies of every object of a kind, ordered by namespace and name."""
        rt = self.registry.find(kind)
        with self.lock:
            return copy.deepcopy(self.items(rt.key, namespace))
