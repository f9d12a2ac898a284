"""The one reflector both the node agent and the arbiter run on: a field-selected list and watch, bookmarks
that move the resume version on while nothing selected changes, a stop that cuts a silent watch at once, and
a callback's failure answered by a fresh list."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import fakes.apiserver
from agent.kube import informer, nodes, slices
from agent.kube.backoff import Backoff
from agent.kube.reflector import Reflector
from agent.kube.rest import NODES


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def test_bookmarks_advance_the_version_and_stop_cuts_a_silent_watch() -> None:
    with fakes.apiserver.start(port=0, bookmark_interval=0.1) as server:
        rest = server.rest()
        rest.create(NODES, None, node("mine"))
        listed: list[list[str]] = []
        events: list[tuple[str, str]] = []
        reflector = Reflector(
            rest,
            NODES,
            lambda items: listed.append([o["metadata"]["name"] for o in items]),
            lambda kind, obj: events.append((kind, obj["metadata"]["name"])),
            field_selector="metadata.name=mine",
            watch_timeout_s=600,
        )
        reflector.start()
        eventually(lambda: listed == [["mine"]])
        first = reflector.resource_version
        for i in range(3):  # changes the selector hides: only bookmarks tell the reflector time moved on
            rest.create(NODES, None, node(f"other-{i}"))
        eventually(lambda: int(reflector.resource_version) > int(first))
        assert events == []
        rest.patch(NODES, None, "mine", {"metadata": {"labels": {"a": "b"}}})
        eventually(lambda: events == [("MODIFIED", "mine")])
        started = time.monotonic()
        reflector.stop()
        assert time.monotonic() - started < 2.0  # the watch would otherwise run for 600 s
        assert reflector.stopped


def test_a_failing_callback_is_answered_with_a_fresh_list() -> None:
    with fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        lists = threading.Semaphore(0)
        failed = threading.Event()

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            if not failed.is_set():
                failed.set()
                raise RuntimeError("a bug in a handler")

        reflector = Reflector(rest, NODES, lambda items: lists.release(), on_event, backoff=Backoff(0.01, 0.05))
        reflector.start()
        assert lists.acquire(timeout=10)
        rest.create(NODES, None, node("n"))
        assert lists.acquire(timeout=10)  # listed again after the failure
        assert reflector.relists == 1
        reflector.stop()


def test_node_agent_and_arbiter_watch_through_the_same_reflector() -> None:
    with fakes.apiserver.start(port=0) as server:
        watcher = nodes.NodeWatcher(server.rest(), "n")
        slice_watch = slices.watch_changes(server.rest(), "n", "gpu.nvidia.com", lambda kind, name: None)
        arbiter_side = informer.Informer(server.rest(), NODES)
        assert isinstance(watcher._watch, Reflector)
        assert isinstance(slice_watch, Reflector)
        assert isinstance(arbiter_side._reflector, Reflector)
