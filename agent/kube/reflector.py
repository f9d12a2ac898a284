"""The one list+watch loop, as client-go's reflector, on the JSON layer (agent.kube.rest): both the node
agent's watches (its Node, its ResourceSlices) and the arbiter's informers run on it.

It lists, then watches from the list's resourceVersion with bookmarks, so a reconnect resumes from a recent
version even when nothing selected changed; a watch the server ends resumes from the last version seen; a 410
Gone (that version is too old) lists again; any other failure backs off (capped, reset by a watch that
worked) and retries: a failed list lists again, a failed watch resumes. A callback that raises is logged and
answered with a fresh list: one bad object never ends the loop. `stop()` ends a watch blocked on a silent
server at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

from agent.jsontypes import Json
from agent.kube.backoff import SPREAD, Backoff
from agent.kube.errors import ApiError, Gone, NotFound
from agent.kube.rest import Resource, Rest

log = logging.getLogger(__name__)


class Reflector:
    """Feeds `on_list(items)` after each list and `on_event(type, obj)` for each ADDED, MODIFIED or DELETED
    after it, until `stop()`. Both run on the reflector's thread: keep them short, no API calls.

    `optional`: the type may not be served yet (a CRD not installed): a 404 calls `on_unserved()` and lists
    again later, instead of counting as a failure.
    """

    def __init__(
        self,
        rest: Rest,
        resource: Resource,
        on_list: Callable[[list[Json]], None],
        on_event: Callable[[str, Json], None],
        *,
        field_selector: str | None = None,
        what: str = "",
        watch_timeout_s: int = 300,
        backoff: Backoff | None = None,
        optional: bool = False,
        on_unserved: Callable[[], None] = lambda: None,
        linger_s: float = 0.0,
    ) -> None:
        self.resource = resource
        self._linger_s = linger_s  # agent.kube.rest.Rest.watch: reads gathered, not one wake-up an event
        self._rest = rest
        self._on_list = on_list
        self._on_event = on_event
        self._selector = field_selector
        self._what = what or resource.plural
        self._timeout_s = watch_timeout_s
        self._backoff = backoff or Backoff(jitter=SPREAD)
        self._optional = optional
        self._on_unserved = on_unserved
        self._stop = threading.Event()
        self._response: Any = None  # the open watch stream, shut by stop()
        self._thread: threading.Thread | None = None
        self.resource_version = ""  # the last version seen (list, event or bookmark)
        self.relists = 0  # lists after the first (410s and failures): for tests and logs

    def start(self, name: str = "") -> None:
        self._thread = threading.Thread(target=self.run, name=name or f"reflector-{self.resource.plural}", daemon=True)
        self._thread.start()

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # already closed: nothing to unblock
                response.shutdown()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=join_s)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        listed = False
        first = True
        while not self._stop.is_set():
            try:
                if not listed:
                    if not first:
                        self.relists += 1
                    first = False
                    self._list()
                    listed = True
                self._watch()  # the server ended the watch: resume where it stopped
                self._backoff.reset()
            except Gone:
                log.info("watch of %s expired (410): listing again", self._what)
                listed = False
            except NotFound as exc:
                if self._stop.is_set():
                    return
                if not self._optional:
                    self._retry(exc)
                    continue
                self._on_unserved()
                listed = False
                self._stop.wait(self._backoff.max_s)
            except ApiError as exc:  # a failed list lists again, a failed watch resumes from the last version
                if self._stop.is_set():
                    return  # a watch cut by the shutdown is no failure
                self._retry(exc)
            except Exception:  # a bug in a callback must not end the watch for good
                delay = self._backoff.next()
                log.exception("handling a change of %s failed, listing again in %.1fs", self._what, delay)
                listed = False
                self._stop.wait(delay)

    def _retry(self, exc: ApiError) -> None:
        delay = self._backoff.next()
        log.warning("watching %s failed, retrying in %.1fs: %s", self._what, delay, exc)
        self._stop.wait(delay)

    def _list(self) -> None:
        body = self._rest.list(self.resource, field_selector=self._selector)
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self._on_list(list(body.get("items") or []))

    def _watch(self) -> None:
        """Follow one watch request until the server ends it (or stop() cuts it)."""
        events = self._rest.watch(
            self.resource,
            self.resource_version,
            timeout_seconds=self._timeout_s,
            field_selector=self._selector,
            opened=self._opened,
            linger_s=self._linger_s,
            pause=self._stop.wait,  # stop() ends a pause at once
        )
        try:
            for event in events:
                if self._stop.is_set():
                    return
                version = str((event.object.get("metadata") or {}).get("resourceVersion") or "")
                if version:
                    self.resource_version = version
                if event.type in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(event.type, event.object)
        finally:
            self._response = None

    def _opened(self, response: Any) -> None:
        self._response = response
        if self._stop.is_set():  # stopped while the request was on its way
            with contextlib.suppress(Exception):
                response.shutdown()


__all__ = ["Reflector"]
