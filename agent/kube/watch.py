"""List then watch one collection, as client-go's reflector does: a watch resumes from the last
resourceVersion seen, a 410 (the server no longer has that version) relists, and any other failure
backs off and relists. Objects are the server's JSON dicts."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

from urllib3.exceptions import HTTPError

from agent.kube.client import REQUEST_TIMEOUT
from agent.kube.errors import ApiError, Gone, call

log = logging.getLogger(__name__)

Json = dict[str, Any]
# Called with `field_selector=`, `resource_version=`, `watch=` and the client's request keywords, as the
# generated `list_*` methods of the kubernetes client are.
ListCall = Callable[..., Any]


class Backoff:
    """Exponential delays between `first_s` and `max_s`, back to `first_s` after a success."""

    def __init__(self, first_s: float = 0.2, max_s: float = 10.0) -> None:
        self._first, self._max = first_s, max_s
        self._next = first_s

    def next(self) -> float:
        delay, self._next = self._next, min(self._next * 2, self._max)
        return delay

    def reset(self) -> None:
        self._next = self._first


class ListWatch:
    """Keeps `on_list` / `on_event` fed with one collection until `stop()`; `run()` blocks, `start()` threads.

    `on_list(items)` gets the whole (selected) collection after each list, `on_event(type, obj)` each
    ADDED, MODIFIED or DELETED after it. Both run on the watch thread: keep them short, no API calls.
    """

    def __init__(
        self,
        list_call: ListCall,
        on_list: Callable[[list[Json]], None],
        on_event: Callable[[str, Json], None],
        *,
        field_selector: str = "",
        what: str = "objects",
        timeout_s: int = 300,
        backoff: Backoff | None = None,
    ) -> None:
        self._list = list_call
        self._on_list = on_list
        self._on_event = on_event
        self._selector = field_selector
        self._what = what
        self._timeout_s = timeout_s
        self._backoff = backoff or Backoff()
        self._stop = threading.Event()
        self._response: Any = None  # the open watch stream, closed by stop()
        self._thread: threading.Thread | None = None

    def start(self, name: str = "watch") -> None:
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            _shut(response)
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run(self) -> None:
        version: str | None = None  # None: list (again) before watching
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._relist()
                version = self._watch(version)  # the server ended the watch: resume where it stopped
                self._backoff.reset()
            except Gone:
                log.info("watch of %s expired, listing again", self._what)
                version = None
            except ApiError as exc:  # a failed list lists again, a failed watch resumes from `version`
                if self._stop.is_set():
                    return
                delay = self._backoff.next()
                log.warning("watching %s failed, retrying in %.1fs: %s", self._what, delay, exc.reason)
                self._stop.wait(delay)
            except Exception:  # a bug in a callback must not end the watch for good
                delay = self._backoff.next()
                log.exception("handling a change of %s failed, listing again in %.1fs", self._what, delay)
                version = None
                self._stop.wait(delay)

    def _relist(self) -> str:
        body = _json(call(lambda: self._list(field_selector=self._selector, _preload_content=False,
                                             _request_timeout=REQUEST_TIMEOUT)))  # fmt: skip
        self._on_list(list(body.get("items") or []))
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _watch(self, version: str) -> str:
        """Follow one watch request until the server ends it; the last resourceVersion seen."""
        response = call(
            lambda: self._list(
                field_selector=self._selector,
                resource_version=version,
                watch=True,
                allow_watch_bookmarks=True,
                timeout_seconds=self._timeout_s,
                _preload_content=False,
                # the read timeout outlasts the server's own end of the watch: a silent server is a dead one
                _request_timeout=(REQUEST_TIMEOUT[0], self._timeout_s + REQUEST_TIMEOUT[1]),
            )
        )
        self._response = response
        try:
            if self._stop.is_set():
                return version
            for event in _events(response):
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise _watch_error(obj)
                version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._on_event(kind, obj)
        except (OSError, ValueError, HTTPError) as exc:
            if self._stop.is_set():
                return version
            raise ApiError(0, f"watch stream broke: {exc}") from exc
        finally:
            self._response = None
            response.release_conn()
        return version


def _events(response: Any) -> Iterator[Json]:
    for line in response:
        if line.strip():
            event: Json = json.loads(line)
            yield event


def _watch_error(status: Json) -> ApiError:
    code = int(status.get("code") or 0)
    message = str(status.get("message") or status)
    return Gone(code, message) if code == 410 else ApiError(code, message)


def _shut(response: Any) -> None:
    """Unblock a thread reading the stream: shutting the socket down ends its read at once."""
    with contextlib.suppress(Exception):  # already closed: nothing to unblock
        response.shutdown()


def _json(response: Any) -> Json:
    data = response.data if hasattr(response, "data") else response
    parsed: Json = json.loads(data) if data else {}
    return parsed
