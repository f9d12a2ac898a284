"""The agent's watch of its own Node against the API fake: every change of uid or labels reaches the
subscribers, other Nodes do not, and a cut, expired (410) or failing watch recovers by listing again."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

import fakes.apiserver
from agent.kube.backoff import Backoff
from agent.kube.nodes import NodeInfo, NodeWatcher

NODE = "node-a"


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0, history=20) as s:
        yield s


class Seen:
    """A subscriber that queues what it is told."""

    def __init__(self) -> None:
        self.infos: queue.Queue[NodeInfo] = queue.Queue()

    def __call__(self, info: NodeInfo) -> None:
        self.infos.put(info)

    def next(self, timeout: float = 5.0) -> NodeInfo:
        return self.infos.get(timeout=timeout)

    def until(self, want: Any, timeout: float = 5.0) -> NodeInfo:
        deadline = time.monotonic() + timeout
        while True:
            info = self.next(max(0.01, deadline - time.monotonic()))
            if want(info):
                return info

    def none_within(self, seconds: float) -> bool:
        try:
            self.infos.get(timeout=seconds)
        except queue.Empty:
            return True
        return False


def create_node(core: client.CoreV1Api, name: str = NODE, labels: dict[str, str] | None = None) -> str:
    node = core.create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}})
    return str(node.metadata.uid)


def label(core: client.CoreV1Api, labels: dict[str, str | None], name: str = NODE) -> None:
    core.patch_node(name, {"metadata": {"labels": labels}})


@pytest.fixture
def core(server: fakes.apiserver.ApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(server.api_client())


def watching(server: fakes.apiserver.ApiServer, **options: Any) -> tuple[NodeWatcher, Seen]:
    watcher = NodeWatcher(server.rest(), NODE, backoff=Backoff(0.05, 0.2), **options)
    seen = Seen()
    watcher.subscribe(seen)
    watcher.start()
    return watcher, seen


def test_first_list_reports_the_node_and_each_label_change_follows(server: Any, core: client.CoreV1Api) -> None:
    uid = create_node(core, labels={"zone": "a"})
    watcher, seen = watching(server)
    try:
        assert seen.next() == NodeInfo(uid, {"zone": "a"})
        assert watcher.current == NodeInfo(uid, {"zone": "a"})
        label(core, {"nvidia.com/mig.config": "all-1g.10gb"})
        assert seen.next() == NodeInfo(uid, {"zone": "a", "nvidia.com/mig.config": "all-1g.10gb"})
        label(core, {"zone": None})
        assert seen.next().labels == {"nvidia.com/mig.config": "all-1g.10gb"}
    finally:
        watcher.stop()


def test_a_recreated_node_is_delivered_with_its_new_uid(server: Any, core: client.CoreV1Api) -> None:
    old = create_node(core)
    watcher, seen = watching(server)
    try:
        assert seen.next().uid == old
        core.delete_node(NODE)
        assert seen.next() == NodeInfo(None)
        new = create_node(core)
        assert new != old
        assert seen.next().uid == new
    finally:
        watcher.stop()


def test_no_node_then_created(server: Any, core: client.CoreV1Api) -> None:
    watcher, seen = watching(server)
    try:
        assert seen.next() == NodeInfo(None)
        assert watcher.wait_synced(0)
        uid = create_node(core)
        assert seen.next().uid == uid
    finally:
        watcher.stop()


def test_other_nodes_and_unchanged_writes_are_not_delivered(server: Any, core: client.CoreV1Api) -> None:
    create_node(core)
    watcher, seen = watching(server)
    try:
        seen.next()
        create_node(core, "node-b")
        label(core, {"x": "1"}, name="node-b")
        core.patch_node(NODE, {"spec": {"unschedulable": True}})  # neither uid nor labels: nothing to tell
        assert seen.none_within(0.5)
    finally:
        watcher.stop()


def test_a_late_subscriber_is_told_the_current_state_at_once(server: Any, core: client.CoreV1Api) -> None:
    uid = create_node(core)
    watcher, seen = watching(server)
    try:
        seen.next()
        late = Seen()
        watcher.subscribe(late)
        assert late.next(0) == NodeInfo(uid)
    finally:
        watcher.stop()


def test_cut_watch_resumes_without_losing_a_change(server: Any, core: client.CoreV1Api) -> None:
    uid = create_node(core)
    watcher, seen = watching(server)
    try:
        seen.next()
        server.drop_watches()  # tried: the connection breaks, as with a restarting API server
        label(core, {"a": "1"})
        assert seen.next() == NodeInfo(uid, {"a": "1"})
    finally:
        watcher.stop()


def test_expired_resource_version_relists(
    server: Any, core: client.CoreV1Api, caplog: pytest.LogCaptureFixture
) -> None:
    """tried: the watch is cut and more changes than the server's history happen before it resumes;
    the resume gets 410 Gone and the watcher lists again instead of missing the label."""
    caplog.set_level(logging.INFO, "agent.kube.reflector")
    uid = create_node(core)
    create_node(core, "node-b")
    watcher, seen = watching(server)
    try:
        seen.next()
        server.faults.fail("GET", "/api/v1/nodes$", status=500, count=1000)  # hold the resume off
        server.drop_watches()
        for i in range(25):  # the fake keeps 20 events
            label(core, {"filler": str(i)}, name="node-b")
        label(core, {"late": "yes"})
        server.faults.clear()
        assert seen.until(lambda i: i.labels.get("late") == "yes") == NodeInfo(uid, {"late": "yes"})
        assert "watch of Node node-a expired (410): listing again" in caplog.text
    finally:
        watcher.stop()


def test_failing_lists_are_retried_with_backoff(server: Any, core: client.CoreV1Api) -> None:
    uid = create_node(core)
    server.faults.fail("GET", "/api/v1/nodes$", status=503, count=3)
    watcher, seen = watching(server)
    try:
        assert seen.next() == NodeInfo(uid)
    finally:
        watcher.stop()


def test_stop_ends_an_open_watch_promptly(server: Any, core: client.CoreV1Api) -> None:
    create_node(core)
    watcher, seen = watching(server)
    seen.next()
    time.sleep(0.2)  # the watch request is open now
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 2
