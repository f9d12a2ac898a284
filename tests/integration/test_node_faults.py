"""The real `gpu-dra-agent node` daemon under API faults (the API fake's fault injection and direct edits
of its store): what the cluster sees of the node's ResourceSlices when its Node or its slices go away."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from kubernetes import client

import fakes.apiserver
from fakes.kubelet import FakeKubelet
from tests.integration.test_node_support import (
    DRIVER,
    NODE,
    Daemon,
    allocate_claim,
    cdi_file,
    create_node,
    running,
    short_tmpdir,
)


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


def slice_key(cluster: Cluster) -> tuple[str, str, str]:
    return cluster.server.registry.find("ResourceSlice").key


def pool_complete(cluster: Cluster) -> bool:
    """What the scheduler needs: every slice of the pool there, all of one generation."""
    slices = cluster.slices()
    pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}
    return len(pools) == 1 and len(slices) == next(iter(pools))[1]


def test_a_deleted_slice_comes_back_at_once(cluster: Cluster) -> None:
    """Tried: the slice deleted behind the agent's back (an API server that lost its store); it used to come
    back only at the next resync, up to 30 s later."""
    [lost] = cluster.slices()
    cluster.server.api.delete(cluster.server.registry.find("ResourceSlice"), "", lost["metadata"]["name"], None)
    assert cluster.slices() == []
    took = eventually(lambda: len(cluster.slices()) == 1, timeout=5, what="the slice back")
    print(f"\nslice back {took:.2f}s after its deletion")


def test_the_agent_warns_about_a_node_name_with_no_node() -> None:
    with short_tmpdir("faults-") as root, fakes.apiserver.start(port=0) as server:
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        with running(daemon):
            record = daemon.wait_for_log(
                f"there is no Node named {NODE}: check --node-name; slices are published without an owner and "
                "withdrawn when the agent stops"
            )
            assert record["level"] == "warning"


@contextmanager
def started_under(faults: Callable[[fakes.apiserver.ApiServer], None]) -> Iterator[Cluster]:
    """A daemon started while `faults` are armed on its API server."""
    with short_tmpdir("faults-") as root, fakes.apiserver.start(port=0) as server:
        create_node(server.api_client())
        faults(server)
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        with running(daemon):
            yield Cluster(server, daemon)


BLIPS: dict[str, Callable[[fakes.apiserver.ApiServer], None]] = {
    "one 500 on the Node GET": lambda s: s.faults.fail("GET", f"/api/v1/nodes/{NODE}$", 500),
    "one 503 on the Node GET": lambda s: s.faults.fail("GET", f"/api/v1/nodes/{NODE}$", 503),
    "five 500s on the slice list": lambda s: s.faults.fail("GET", "/resourceslices$", 500, count=5),
    "twenty 503s on every request": lambda s: s.faults.fail("*", "", 503, count=20),
}


@pytest.mark.parametrize("blip", list(BLIPS), ids=list(BLIPS))
def test_start_up_survives_an_api_blip(blip: str) -> None:
    """Tried: each of these made the agent exit within 3 s on main, leaving the node unable to unprepare."""
    with started_under(BLIPS[blip]) as cluster:
        # generous: this is about surviving, and the machine running the tests may be busy
        eventually(lambda: pool_complete(cluster) and cluster.owners() == {cluster.node_uid()}, 30, "the pool")
        assert cluster.daemon.proc is not None and cluster.daemon.proc.poll() is None


def test_a_burst_of_500s_mid_publish_leaves_mixed_generations_for_seconds_not_a_resync() -> None:
    """Tried: the Node re-created (every slice is rewritten for the new owner) while writes of the second
    slice fail 12 times in a row; the pool stays incomplete to the scheduler until the publisher tries again,
    which used to wait for the next 30 s resync."""
    # Partitionable devices make a DGX H100 pool of two slices; the agent publishes them in the 1.34 shape.
    combined_counters = {"kubernetes_version": "1.34", "feature_gates": {"DRAPartitionableDevices": True}}
    with short_tmpdir("faults-") as root, fakes.apiserver.start(port=0, **combined_counters) as server:
        create_node(server.api_client())
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"), env={"PARTITIONABLE_DEVICES": "1"})
        with running(daemon):
            cluster = Cluster(server, daemon)
            eventually(lambda: pool_complete(cluster), 30, "the pool")
            names = sorted(s["metadata"]["name"] for s in cluster.slices())
            server.faults.fail("PUT", f"/resourceslices/{names[-1]}$", 500, count=12)
            cluster.core.delete_node(NODE)
            create_node(server.api_client())
            new = cluster.node_uid()
            assert len(names) > 1
            eventually(lambda: not pool_complete(cluster), timeout=5, what="a half-written pool")
            took = eventually(
                lambda: pool_complete(cluster) and cluster.owners() == {new}, timeout=25, what="the pool whole again"
            )
            print(f"\npool whole again {took:.2f}s after it was left half-written")


def test_while_the_api_is_away_unprepare_works_from_the_checkpoint_and_prepare_refuses_clearly() -> None:
    """Tried: the agent restarted while its API server is unreachable (connection refused). It must come up,
    serve the kubelet, unprepare a claim prepared before, refuse a prepare with the reason, and publish
    its slices once the API server is back."""
    with short_tmpdir("faults-") as root:
        with fakes.apiserver.start(port=0) as server:
            port = server.port
            create_node(server.api_client())
            held = allocate_claim(server.api_client(), "held", ["gpu-0"])
            fresh = allocate_claim(server.api_client(), "fresh", ["gpu-1"])
            daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
            with running(daemon), FakeKubelet(daemon.kubelet_root) as kubelet:
                kubelet.wait_for_driver(DRIVER)
                assert kubelet.prepare(DRIVER, [held])[held.uid].error == ""
                assert daemon.terminate() == 0
        # the API server is gone now: connections to its port are refused
        with running(daemon), FakeKubelet(daemon.kubelet_root) as kubelet:
            kubelet.wait_for_driver(DRIVER)
            assert cdi_file(daemon.cdi_root, held).exists()
            assert kubelet.unprepare(DRIVER, [held]) == {held.uid: ""}
            assert not cdi_file(daemon.cdi_root, held).exists()
            error = kubelet.prepare(DRIVER, [fresh])[fresh.uid].error
            assert "cannot reach the API server" in error, error
            assert daemon.proc is not None and daemon.proc.poll() is None
            with fakes.apiserver.start(port=port) as server:  # back, empty (it lost its store)
                create_node(server.api_client())
                cluster = Cluster(server, daemon)
                eventually(lambda: pool_complete(cluster) and cluster.owners() == {cluster.node_uid()}, 30, "the pool")
