"""The real `gpu-dra-agent node` daemon under API faults (the API fake's fault injection and direct edits
of its store): what the cluster sees of the node's ResourceSlices when its Node or its slices go away."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

import fakes.apiserver
from tests.integration.test_node_support import NODE, Daemon, create_node, running, short_tmpdir


class Cluster:
    def __init__(self, server: fakes.apiserver.ApiServer, daemon: Daemon) -> None:
        self.server = server
        self.core = client.CoreV1Api(server.api_client())
        self.daemon = daemon

    def node_uid(self) -> str:
        return str(self.server.store.get("Node", NODE)["metadata"]["uid"])  # type: ignore[index]

    def slices(self) -> list[dict[str, Any]]:
        return self.server.store.objects("ResourceSlice")

    def owners(self) -> set[str]:
        return {r["uid"] for s in self.slices() for r in s["metadata"].get("ownerReferences") or []}


def eventually(condition: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> float:
    """Seconds until `condition` held; fails after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        time.sleep(0.05)
    return time.monotonic() - started


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with short_tmpdir("faults-") as root, fakes.apiserver.start(port=0) as server:
        create_node(server.api_client())
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        with running(daemon):
            yield Cluster(server, daemon)


def test_a_recreated_node_owns_the_republished_slices(cluster: Cluster) -> None:
    """Tried: the Node object is deleted and created again (a node re-joining). A real cluster's garbage
    collector deletes slices owned by the old uid; the agent must republish them owned by the new one."""
    old = cluster.node_uid()
    assert cluster.owners() == {old}
    cluster.core.delete_node(NODE)
    for s in cluster.slices():  # what the garbage collector does to dependents of a deleted owner
        cluster.server.store.remove(cluster.server.registry.find("ResourceSlice").key, s)
    create_node(cluster.server.api_client())
    new = cluster.node_uid()
    assert new != old
    # well within the 30 s resync: the agent saw the Node change
    eventually(
        lambda: cluster.owners() == {new} and len(cluster.slices()) > 0, timeout=5, what="slices owned by new uid"
    )


def test_a_recreated_node_with_slices_left_in_place_takes_them_over(cluster: Cluster) -> None:
    """Tried: Node deleted and re-created before any garbage collection: the surviving slices still name the
    old uid and would be collected later; the agent rewrites their owner."""
    old = cluster.node_uid()
    cluster.core.delete_node(NODE)
    create_node(cluster.server.api_client())
    new = cluster.node_uid()
    eventually(lambda: cluster.owners() == {new}, timeout=5, what="slices owned by the new uid")
    assert old not in cluster.owners()
