"""NodeLabelWatch against the API fake: the labels after the first list, each change, and a dropped watch or a
failing list survived by listing again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from kubernetes import client

import fakes.apiserver
from agent.kube.nodes import NodeLabelWatch
from tests.integration.test_node_support import NODE, create_node


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        create_node(srv.api_client())
        yield srv


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout}s"
        time.sleep(0.01)


def label(server: fakes.apiserver.ApiServer, value: str) -> None:
    body = {"metadata": {"labels": {"nvidia.com/mig.config": value}}}
    client.CoreV1Api(server.api_client()).patch_node(NODE, body)


def test_labels_after_the_list_and_on_each_change_through_dropped_watches(server: fakes.apiserver.ApiServer) -> None:
    seen: list[dict[str, str]] = []
    stop = threading.Event()
    watcher = NodeLabelWatch(server.api_client(), NODE, seen.append, timeout_s=5, backoff_s=0.05)
    thread = threading.Thread(target=watcher.run, args=(stop,), daemon=True)
    thread.start()
    try:
        wait_for(lambda: seen == [{}], "first list")
        label(server, "all-1g.10gb")
        wait_for(lambda: seen[-1:] == [{"nvidia.com/mig.config": "all-1g.10gb"}], "the change")
        # Tried: the server cuts every watch, then refuses the next list once; the change still arrives.
        server.faults.fail("GET", r"^/api/v1/nodes$", status=500, count=1)
        server.drop_watches()
        label(server, "all-balanced")
        wait_for(lambda: seen[-1:] == [{"nvidia.com/mig.config": "all-balanced"}], "the change after a drop")
        # An unrelated change of another Node is not delivered.
        create_node(server.api_client(), "other")
        time.sleep(0.2)
        assert seen == [{}, {"nvidia.com/mig.config": "all-1g.10gb"}, {"nvidia.com/mig.config": "all-balanced"}]
    finally:
        stop.set()
