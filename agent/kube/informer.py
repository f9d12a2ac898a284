"""An informer: a local copy of one resource type, kept current by list + watch.

Its list and watch are agent.kube.reflector's: list, watch from the list's resourceVersion with bookmarks,
list again on 410 Gone (the copy is replaced whole, so objects deleted meanwhile disappear), capped backoff
on other failures. `on_change` is called after every change, from
the informer's thread: it must be quick (set an Event). `on_event(type, object)`, when given, is told each
watch event (type ADDED, MODIFIED, DELETED) or "SYNC" with every object after a list. Indexers keep objects
findable by a derived key (e.g. a claim by the pool its devices come from) without scanning the copy.
Objects are kept without `metadata.managedFields`, as kube-scheduler's pod informer keeps them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from agent.jsontypes import Json
from agent.kube.backoff import SPREAD, Backoff
from agent.kube.errors import ApiError
from agent.kube.reflector import Reflector
from agent.kube.rest import Resource, Rest

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace or "", name)


def key_of(obj: Json) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


class Informer:
    def __init__(
        self,
        rest: Rest,
        resource: Resource,
        on_change: Callable[[], None] = lambda: None,
        *,
        watch_timeout_s: int = 300,
        max_backoff_s: float = 5.0,
        optional: bool = False,
        indexers: Mapping[str, Callable[[Json], Iterable[str]]] | None = None,
        on_event: Callable[[str, Json], None] | None = None,
        linger_s: float = 0.0,
    ) -> None:
        self.resource = resource
        self._indexers = dict(indexers or {})
        self._index: dict[str, dict[str, dict[Key, Json]]] = {name: {} for name in self._indexers}
        self._on_event = on_event
        self._on_change = on_change
        self._lock = threading.Lock()
        self._objects: dict[Key, Json] = {}
        self._synced = threading.Event()
        # optional: a type the server may not serve (a CRD not installed yet): empty until it is
        self._reflector = Reflector(
            rest,
            resource,
            self._listed,
            self._changed,
            watch_timeout_s=watch_timeout_s,
            backoff=Backoff(0.1, max_backoff_s, jitter=SPREAD),
            optional=optional,
            on_unserved=self._unserved,
            linger_s=linger_s,
        )

    # -- reading ----------------------------------------------------------------------------------------

    def items(self) -> list[Json]:
        """The objects as last seen (shared dicts: do not modify)."""
        with self._lock:
            return list(self._objects.values())

    def get(self, namespace: str, name: str) -> Json | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def by_index(self, index: str, value: str) -> list[Json]:
        """The objects whose indexer `index` yields `value`."""
        with self._lock:
            return list(self._index[index].get(value, {}).values())

    def _unindex(self, key: Key, obj: Json | None) -> None:
        if obj is None:
            return
        for name, fn in self._indexers.items():
            for value in fn(obj):
                bucket = self._index[name].get(value)
                if bucket is not None:
                    bucket.pop(key, None)
                    if not bucket:
                        del self._index[name][value]

    def _reindex(self, key: Key, obj: Json) -> None:
        for name, fn in self._indexers.items():
            for value in fn(obj):
                self._index[name].setdefault(value, {})[key] = obj

    @property
    def resource_version(self) -> str:
        return self._reflector.resource_version

    @property
    def relists(self) -> int:
        """Lists after the first one (410s and failures): for tests and logs."""
        return self._reflector.relists

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    # -- running ----------------------------------------------------------------------------------------

    def start(self) -> Informer:
        self._reflector.start(f"informer-{self.resource.plural}")
        return self

    def stop(self) -> None:
        self._reflector.stop(join_s=0)

    def _unserved(self) -> None:
        if not self._synced.is_set():
            log.warning("%s are not served; treating them as none until they are", self.resource.plural)
        self._synced.set()

    def _listed(self, items: list[Json]) -> None:
        objects = {key_of(o): _stored(o, self.resource) for o in items}
        with self._lock:
            self._objects = objects
            self._index = {name: {} for name in self._indexers}
            for key, obj in objects.items():
                self._reindex(key, obj)
        self._synced.set()
        if self._on_event is not None:
            for obj in objects.values():
                self._on_event("SYNC", obj)
        self._on_change()

    def _changed(self, kind: str, obj: Json) -> None:
        key = key_of(obj)
        with self._lock:
            if kind == "DELETED":
                self._unindex(key, self._objects.pop(key, None))
            else:
                self._unindex(key, self._objects.get(key))
                self._objects[key] = _stored(obj, self.resource)
                self._reindex(key, obj)
        if self._on_event is not None:
            self._on_event(kind, obj)
        self._on_change()


def _stored(obj: Json, resource: Resource) -> Json:
    # list items carry no apiVersion/kind; writers that send an object back need them
    obj.setdefault("apiVersion", resource.api_version)
    # managedFields are the server's bookkeeping, read by nothing here; an update without them keeps the
    # server's, so dropping them spares every copy, PUT and server-side decode of them
    (obj.get("metadata") or {}).pop("managedFields", None)
    return obj


def start_all(informers: list[Informer], timeout: float) -> None:
    """Start every informer and wait until each has listed once; raises ApiError naming the ones that did not."""
    for inf in informers:
        inf.start()
    late = [inf.resource.plural for inf in informers if not inf.wait_synced(timeout)]
    if late:
        raise ApiError(0, f"could not list {', '.join(late)} within {timeout:.0f}s")


__all__ = ["Informer", "Key", "key_of", "start_all"]
