"""core/v1 Events about objects, as client-go's recorder writes them: one Event per (object, reason,
message), its count raised when the same thing happens again, so `kubectl describe` shows why. The counts of
the last MAX_REMEMBERED Events are kept (client-go's correlator keeps as many); an older one, or one the API
server has expired (Events live an hour), is read back or written anew.

As client-go's broadcaster, recording only queues the Event; a thread writes it. The caller never waits for
the API server, and when the queue is full (an API server that cannot keep up) Events are dropped, counted
in `dropped`, rather than slowing what they describe."""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.rest import EVENTS, Rest
from agent.times import rfc3339

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096  # Events whose count is kept here; a long-running agent or arbiter stays bounded


class _Pending(NamedTuple):
    """An Event recorded, not yet written."""

    obj: Mapping[str, Any]
    kind: str
    api_version: str
    reason: str
    message: str
    type_: str

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.obj.get("metadata") or {}

    @property
    def namespace(self) -> str:
        return str(self.meta.get("namespace") or "default")


class EventRecorder:
    def __init__(
        self,
        rest: Rest,
        component: str,
        instance: str,
        clock: Callable[[], float] = time.time,
        *,
        queue_size: int = 1000,
    ) -> None:
        self._rest = rest
        self._component = component
        self._instance = instance
        self._clock = clock
        self._counts: OrderedDict[str, int] = OrderedDict()  # event name -> count written, the latest last
        self._queue: queue.Queue[_Pending | None] = queue.Queue(queue_size)
        self.dropped = 0
        self._thread = threading.Thread(target=self._drain, name="events", daemon=True)
        self._thread.start()

    def record(
        self, obj: Mapping[str, Any], kind: str, api_version: str, reason: str, message: str, *, type_: str = "Normal"
    ) -> None:
        """Queue an Event about `obj`; never blocks, never raises."""
        try:
            self._queue.put_nowait(_Pending(obj, kind, api_version, reason, message, type_))
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued Event is written (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is not None:
                    self._write(item)
            finally:
                self._queue.task_done()

    def _write(self, item: _Pending) -> None:
        """Best effort: an Event that cannot be written is logged, never raised."""
        meta, namespace = item.meta, item.namespace
        digest = hashlib.sha256(f"{meta.get('uid')}/{item.reason}/{item.message}".encode()).hexdigest()[:10]
        name = f"{meta.get('name')}.{digest}"
        now = rfc3339(self._clock())
        known = self._counts.pop(name, None)  # only this thread reads or writes the counts
        try:
            if known is not None:
                count = known + 1
                try:
                    self._rest.patch(EVENTS, namespace, name, {"count": count, "lastTimestamp": now})
                except NotFound:  # expired by the server meanwhile: written anew, its count kept
                    self._create(item, name, count, now)
            else:
                count = 1
                try:
                    self._create(item, name, count, now)
                except Conflict:  # forgotten here, still there: its count read back and raised
                    count = int(self._rest.get(EVENTS, namespace, name).get("count") or 1) + 1
                    self._rest.patch(EVENTS, namespace, name, {"count": count, "lastTimestamp": now})
            self._counts[name] = count
            if len(self._counts) > MAX_REMEMBERED:
                self._counts.popitem(last=False)
        except ApiError as exc:
            log.debug("event %s/%s not written: %s", namespace, name, exc)

    def _create(self, item: _Pending, name: str, count: int, now: str) -> None:
        meta, namespace = item.meta, item.namespace
        self._rest.create(
            EVENTS,
            namespace,
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": name, "namespace": namespace},
                "involvedObject": {
                    "apiVersion": item.api_version,
                    "kind": item.kind,
                    "name": meta.get("name"),
                    "namespace": namespace,
                    "uid": meta.get("uid"),
                },
                "reason": item.reason,
                "message": item.message[:1024],
                "type": item.type_,
                "count": count,
                "firstTimestamp": now,
                "lastTimestamp": now,
                "source": {"component": self._component},
                "reportingComponent": self._component,
                "reportingInstance": self._instance,
            },
        )
