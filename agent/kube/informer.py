"""An informer: a local copy of one resource type, kept current by list + watch.

It lists once, then watches from the list's resourceVersion with bookmarks (so a reconnect resumes from a
recent version even when nothing of ours changed); when the server answers 410 Gone the version is too old
and it lists again, replacing the copy whole (objects deleted meanwhile disappear). Any other failure is
retried with a capped backoff from the last version seen. `on_change` is called after every change, from
the informer's thread: it must be quick (set an Event).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from agent.kube.errors import ApiError, Gone, NotFound
from agent.kube.rest import Json, Resource, Rest

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (namespace or "", name)


def key_of(obj: Json) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


class Informer:
    def __init__(self, rest: Rest, resource: Resource, on_change: Callable[[], None] = lambda: None, *,
                 watch_timeout_s: int = 300, max_backoff_s: float = 5.0, optional: bool = False) -> None:
        self.resource = resource
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
            except Gone:
                log.info("watch of %s expired (410): listing again", self.resource.plural)
                listed = False
                self.relists += 1
            except NotFound as exc:
                if not self._optional:
                    log.warning("informer for %s: %s; retrying in %.1fs", self.resource.plural, exc, backoff)
                    self._stop.wait(backoff)
                    backoff = min(self._max_backoff, backoff * 2)
                    continue
                if not self._synced.is_set():
                    log.warning("%s are not served; treating them as none until they are", self.resource.plural)
                self._synced.set()
                listed = False
                self._stop.wait(self._max_backoff)
            except ApiError as exc:
                log.warning("informer for %s: %s; retrying in %.1fs", self.resource.plural, exc, backoff)
                self._stop.wait(backoff)
                backoff = min(self._max_backoff, backoff * 2)
            except Exception:  # keep the copy alive whatever happens; the next list repairs it
                log.exception("informer for %s failed; listing again", self.resource.plural)
                listed = False
                self.relists += 1
                self._stop.wait(backoff)
                backoff = min(self._max_backoff, backoff * 2)

    def _list(self) -> None:
        body = self._rest.list(self.resource)
        objects = {key_of(o): _with_kind(o, self.resource) for o in body.get("items") or []}
        with self._lock:
            self._objects = objects
            self._version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self._synced.set()
        self._on_change()

    def _watch(self) -> None:
        for event in self._rest.watch(self.resource, self._version, timeout_seconds=self._watch_timeout):
            if self._stop.is_set():
                return
            obj = event.object
            version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
            with self._lock:
                if event.type == "DELETED":
                    self._objects.pop(key_of(obj), None)
                elif event.type in ("ADDED", "MODIFIED"):
                    self._objects[key_of(obj)] = _with_kind(obj, self.resource)
                if version:
                    self._version = version
            if event.type != "BOOKMARK":
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
