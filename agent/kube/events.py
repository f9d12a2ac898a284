"""core/v1 Events about objects, as client-go's recorder writes them: one Event per (object, reason,
message), its count raised when the same thing happens again, so `kubectl describe` shows why.

As client-go's broadcaster, recording only queues the Event; a thread writes it. The caller never waits for
the API server, and when the queue is full (an API server that cannot keep up) Events are dropped, counted
in `dropped`, rather than slowing what they describe."""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from agent.kube.errors import ApiError
from agent.kube.rest import EVENTS, Rest
from agent.times import rfc3339

log = logging.getLogger(__name__)


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
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}  # event name -> count written
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue(queue_size)
        self.dropped = 0
        self._thread = threading.Thread(target=self._drain, name="events", daemon=True)
        self._thread.start()

    def record(
        self, obj: Mapping[str, Any], kind: str, api_version: str, reason: str, message: str, *, type_: str = "Normal"
    ) -> None:
        """Queue an Event about `obj`; never blocks, never raises."""
        try:
            self._queue.put_nowait((obj, kind, api_version, reason, message, type_))
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

    def _write(self, item: tuple[Any, ...]) -> None:
        """Best effort: an Event that cannot be written is logged, never raised."""
        obj, kind, api_version, reason, message, type_ = item
        meta = obj.get("metadata") or {}
        namespace = str(meta.get("namespace") or "default")
        digest = hashlib.sha256(f"{meta.get('uid')}/{reason}/{message}".encode()).hexdigest()[:10]
        name = f"{meta.get('name')}.{digest}"
        now = rfc3339(self._clock())
        with self._lock:
            count = self._counts.get(name, 0) + 1
            self._counts[name] = count
        try:
            if count > 1:
                self._rest.patch(EVENTS, namespace, name, {"count": count, "lastTimestamp": now})
                return
            self._rest.create(
                EVENTS,
                namespace,
                {
                    "apiVersion": "v1",
                    "kind": "Event",
                    "metadata": {"name": name, "namespace": namespace},
                    "involvedObject": {
                        "apiVersion": api_version,
                        "kind": kind,
                        "name": meta.get("name"),
                        "namespace": namespace,
                        "uid": meta.get("uid"),
                    },
                    "reason": reason,
                    "message": message[:1024],
                    "type": type_,
                    "count": 1,
                    "firstTimestamp": now,
                    "lastTimestamp": now,
                    "source": {"component": self._component},
                    "reportingComponent": self._component,
                    "reportingInstance": self._instance,
                },
            )
        except ApiError as exc:
            log.debug("event %s/%s not written: %s", namespace, name, exc)
