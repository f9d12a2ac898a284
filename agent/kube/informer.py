"""An informer: a local copy of one resource type, kept current by list + watch.

It lists once, then watches from the list's resourceVersion with bookmarks (so a reconnect resumes from a
recent version even when nothing of ours changed); when the server answers 410 Gone the version is too old
and it lists again, replacing the copy whole (objects deleted meanwhile disappear). Any other failure is
retried with a capped backoff from the last version seen. `on_change` is called after every change, from
the informer's thread: it must be quick (set an Event). `on_event(type, object)`, when given, is told each
watch event (type ADDED, MODIFIED, DELETED) or "SYNC" with every object after a list. Indexers keep objects
findable by a derived key (e.g. a claim by the pool its devices come from) without scanning the copy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from agent.kube.errors import ApiError, Gone, NotFound
from agent.kube.rest import Json, Resource, Rest

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace or "", name)


def key_of(obj: Json) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


class Informer:
    def __init__(self, rest: Rest, resource: Resource, on_change: Callable[[], None] = lambda: None, *,
                 watch_timeout_s: int = 300, max_backoff_s: float = 5.0, optional: bool = False,
                 indexers: Mapping[str, Callable[[Json], Iterable[str]]] | None = None,
                 on_event: Callable[[str, Json], None] | None = None) -> None:
        self.resource = resource
        self._indexers = dict(indexers or {})
        self._index: dict[str, dict[str, dict[Key, Json]]] = {name: {} for name in self._indexers}
        self._on_event = on_event
        self._optional = optional  # a type the server may not serve (a CRD not installed yet): empty until it is
        self._rest = rest
        self._on_change = on_change
        self._watch_timeout = watch_timeout_s
        self._max_backoff = max_backoff_s
        self._lock = threading.Lock()
        self._objects: dict[Key, Json] = {}
        self._version = ""
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.relists = 0  # lists after the first one (410s and failures): for tests and logs

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
        return self._version

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._synced.wait(timeout)

    # -- running ----------------------------------------------------------------------------------------

    def start(self) -> Informer:
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.resource.plural}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        backoff = 0.1
        listed = False
        while not self._stop.is_set():
            try:
                if not listed:
                    self._list()
                    listed = True
                self._watch()
                backoff = 0.1
                continue
            except Gone:
                log.info("watch of %s expired (410): listing again", self.resource.plural)
                listed = False
                self.relists += 1
                continue
            except NotFound as exc:
                if self._optional and not self._stop.is_set():
                    if not self._synced.is_set():
                        log.warning("%s are not served; treating them as none until they are", self.resource.plural)
                    self._synced.set()
                    listed = False
                    self._stop.wait(self._max_backoff)
                    continue
                failure: Exception = exc
            except ApiError as exc:
                failure = exc
            except Exception as exc:  # keep the copy alive whatever happens; the next list repairs it
                failure = exc
                listed = False
                self.relists += 1
            if self._stop.is_set():
                return  # a watch cut by the shutdown is no failure
            if isinstance(failure, ApiError):
                log.warning("informer for %s: %s; retrying in %.1fs", self.resource.plural, failure, backoff)
            else:
                log.error("informer for %s failed (%r); listing again", self.resource.plural, failure)
            self._stop.wait(backoff)
            backoff = min(self._max_backoff, backoff * 2)

    def _list(self) -> None:
        body = self._rest.list(self.resource)
        objects = {key_of(o): _with_kind(o, self.resource) for o in body.get("items") or []}
        with self._lock:
            self._objects = objects
            self._index = {name: {} for name in self._indexers}
            for key, obj in objects.items():
                self._reindex(key, obj)
            self._version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self._synced.set()
        if self._on_event is not None:
            for obj in objects.values():
                self._on_event("SYNC", obj)
        self._on_change()

    def _watch(self) -> None:
        for event in self._rest.watch(self.resource, self._version, timeout_seconds=self._watch_timeout):
            if self._stop.is_set():
                return
            obj = event.object
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            key = key_of(obj)
            with self._lock:
                if event.type == "DELETED":
                    self._unindex(key, self._objects.pop(key, None))
                elif event.type in ("ADDED", "MODIFIED"):
                    self._unindex(key, self._objects.get(key))
                    self._objects[key] = _with_kind(obj, self.resource)
                    self._reindex(key, obj)
                if version:
                    self._version = version
            if event.type != "BOOKMARK":
                if self._on_event is not None:
                    self._on_event(event.type, obj)
                self._on_change()


def _with_kind(obj: Json, resource: Resource) -> Json:
    # list items carry no apiVersion/kind; writers that send an object back need them
    obj.setdefault("apiVersion", resource.api_version)
    return obj


def start_all(informers: list[Informer], timeout: float) -> None:
    """Start every informer and wait until each has listed once; raises ApiError naming the ones that did not."""
    for inf in informers:
        inf.start()
    late = [inf.resource.plural for inf in informers if not inf.wait_synced(timeout)]
    if late:
        raise ApiError(0, f"could not list {', '.join(late)} within {timeout:.0f}s")


__all__ = ["Informer", "Key", "key_of", "start_all"]
