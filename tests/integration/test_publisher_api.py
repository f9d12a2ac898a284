"""The publisher against the embedded API server: what a cluster sees of this node's GPUs."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

import fakes.apiserver
import fakes.nvml
from agent.devices.model import Inventory
from agent.kube.errors import ApiError
from agent.kube.rest import Rest
from agent.kube.slices import SliceApi
from agent.slices.build import build_resource_slices
from agent.slices.publisher import Publisher
from agent.slices.versions import rules_for
from tests.unit.test_slices_factory import dgx_h100, h100, mig_device, nvswitch_inventory
from tests.unit.upstream_slice_rules import pool_errors

NODE = "node-a"
DRIVER = "gpu.nvidia.com"

# The agent publishes counters beside the devices that consume them (the 1.34 shape), which 1.35+ rejects: these
# tests run against 1.34 with DRAPartitionableDevices on until the agent publishes the split shape (issue 8).
COMBINED_COUNTERS_SERVER: dict = {"kubernetes_version": "1.34", "feature_gates": {"DRAPartitionableDevices": True}}


class CountingStore(SliceApi):
    """SliceApi that counts the calls the publisher makes."""

    def __init__(self, rest: Rest) -> None:
        super().__init__(rest)
        self.calls: list[str] = []

    def list(self, node_name: str, driver: str) -> list[dict[str, Any]]:
        self.calls.append("list")
        return super().list(node_name, driver)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("create")
        return super().create(body)

    def replace(self, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append("replace")
        return super().replace(body)

    def delete(self, name: str) -> None:
        self.calls.append("delete")
        super().delete(name)

    def writes(self) -> list[str]:
        return [c for c in self.calls if c != "list"]


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0, **COMBINED_COUNTERS_SERVER) as srv:
        yield srv


@pytest.fixture
def node_uid(server: fakes.apiserver.ApiServer) -> str:
    node = client.CoreV1Api(server.api_client()).create_node({"metadata": {"name": NODE}})
    return str(node.metadata.uid)


def publisher(server: fakes.apiserver.ApiServer, **options: Any) -> tuple[Publisher, CountingStore]:
    rest = server.rest()
    store = CountingStore(rest)
    options.setdefault("sleep", lambda _s: None)
    return Publisher(rest, NODE, DRIVER, store=store, **options), store


def slices_in_api(server: fakes.apiserver.ApiServer) -> list[dict[str, Any]]:
    return sorted(SliceApi(server.rest()).list(NODE, DRIVER), key=lambda s: s["metadata"]["name"])


def device_names(slices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for s in slices for d in s["spec"].get("devices", [])]


def pools(slices: list[dict[str, Any]]) -> set[tuple[int, int]]:
    return {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}


def test_first_publish_creates_the_pool_owned_by_the_node(server: Any, node_uid: str) -> None:
    pub, store = publisher(server)
    result = pub.publish(dgx_h100())
    assert (result.devices, result.slices, result.generation, result.created) == (8, 1, 1, 1)
    (s,) = slices_in_api(server)
    assert s["metadata"]["ownerReferences"][0]["uid"] == node_uid
    assert s["spec"]["nodeName"] == NODE and s["spec"]["pool"]["name"] == NODE
    assert s["spec"]["devices"] == build_resource_slices(dgx_h100(), NODE)[0]["spec"]["devices"]
    assert pub.published_devices == 8
    assert store.writes() == ["create"]


def test_nothing_changed_means_nothing_written(server: Any, node_uid: str) -> None:
    pub, store = publisher(server)
    pub.publish(dgx_h100())
    version = server.store.resource_version
    store.calls.clear()
    again = pub.publish(dgx_h100())
    assert store.calls == []  # not even a list: the content is what was last published
    assert not again.wrote and again.generation == 1 and again.devices == 8
    resynced = pub.resync()
    assert store.calls == ["list"] and not resynced.wrote
    assert server.store.resource_version == version

    # A restarted agent finds its pool as it left it and writes nothing either.
    fresh, fresh_store = publisher(server)
    assert not fresh.publish(dgx_h100()).wrote
    assert fresh_store.writes() == []


def test_inventory_change_bumps_the_generation(server: Any, node_uid: str) -> None:
    pub, _ = publisher(server)
    pub.publish(dgx_h100())
    gpu0 = h100(0, mig_enabled=True)
    mig_on = nvswitch_inventory([gpu0, *(h100(i) for i in range(1, 8))], migs=(mig_device(gpu0, "1g.10gb", 0),))
    result = pub.publish(mig_on)
    assert result.generation == 2 and result.updated == 1
    (s,) = slices_in_api(server)
    assert s["spec"]["pool"]["generation"] == 2
    assert device_names([s])[:2] == ["gpu-0-mig-1g10gb-19-0", "gpu-1"]


def test_pool_shrinking_from_two_slices_to_one_deletes_the_extra(server: Any, node_uid: str) -> None:
    pub, store = publisher(server)
    big = dataclasses.replace(dgx_h100(), gpus=tuple(h100(i) for i in range(200)))
    assert pub.publish(big).created == 2
    assert pools(slices_in_api(server)) == {(1, 2)}
    store.calls.clear()
    result = pub.publish(dgx_h100())
    assert (result.updated, result.deleted, result.generation) == (1, 1, 2)
    assert pools(slices_in_api(server)) == {(2, 1)}
    assert device_names(slices_in_api(server)) == [f"gpu-{i}" for i in range(8)]


def test_slice_deleted_behind_our_back_is_recreated(server: Any, node_uid: str) -> None:
    pub, _ = publisher(server)
    pub.publish(dgx_h100())
    SliceApi(server.rest()).delete(f"{NODE}-gpu-nvidia-com-0")
    assert slices_in_api(server) == []
    result = pub.resync()
    assert result.created == 1 and result.generation == 2
    assert device_names(slices_in_api(server)) == [f"gpu-{i}" for i in range(8)]


def test_slice_edited_behind_our_back_is_restored(server: Any, node_uid: str) -> None:
    pub, _ = publisher(server)
    pub.publish(dgx_h100())
    api = SliceApi(server.rest())
    (s,) = api.list(NODE, DRIVER)
    s["spec"]["devices"] = s["spec"]["devices"][:3]
    api.replace(s)
    result = pub.resync()
    assert result.updated == 1 and result.generation == 2
    assert device_names(slices_in_api(server)) == [f"gpu-{i}" for i in range(8)]


def test_conflict_is_retried_by_re_reading(server: Any, node_uid: str) -> None:
    pub, store = publisher(server)
    pub.publish(dgx_h100())
    server.faults.fail("PUT", r"/resourceslices/", status=409, count=1)
    result = pub.publish(dgx_h100(memory_bytes=40 * 2**30))
    assert result.generation == 2
    assert store.calls[-4:] == ["list", "replace", "list", "replace"]  # the 409, then the re-read
    (s,) = slices_in_api(server)
    assert s["spec"]["devices"][0]["capacity"]["memory"]["value"] == "40Gi"


def test_server_errors_back_off_then_succeed(server: Any, node_uid: str) -> None:
    sleeps: list[float] = []
    pub, _ = publisher(server, sleep=sleeps.append, backoff_s=0.1)
    server.faults.fail("POST", r"/resourceslices", status=500, count=2)
    result = pub.publish(dgx_h100())
    assert result.created == 1
    assert sleeps == [0.1, 0.2]


def test_a_pass_cut_short_resumes_its_generation_writing_only_what_is_missing(server: Any, node_uid: str) -> None:
    """Tried: the second slice of a two-slice pool fails with 500 on every attempt of one pass. The retries
    (and the next pass) send only that slice, under the generation the first slice already carries; they
    used to rewrite the whole pool under a new generation each time, so each retry cost a pool's worth."""
    sleeps: list[float] = []
    pub, store = publisher(server, sleep=sleeps.append, backoff_s=0.1, max_attempts=3)
    big = dataclasses.replace(dgx_h100(), gpus=tuple(h100(i) for i in range(200)))
    assert pub.publish(big).created == 2
    more = dataclasses.replace(big, gpus=tuple(h100(i) for i in range(201)))
    second = slices_in_api(server)[1]["metadata"]["name"]
    server.faults.fail("PUT", f"/resourceslices/{second}$", status=500, count=4)
    store.calls.clear()
    with pytest.raises(ApiError):
        pub.publish(more)
    assert store.writes() == ["replace"] * 4  # the first slice once, then only the failing one
    assert sleeps == [0.1, 0.2]  # no pause after the last attempt: the caller decides when to come back
    assert pools(slices_in_api(server)) == {(2, 2), (1, 2)}  # half written: the scheduler waits
    store.calls.clear()
    result = pub.resync()
    assert store.writes() == ["replace", "replace"]  # one more 500, then the missing slice, nothing else
    assert result.generation == 2 and result.updated == 1
    assert pools(slices_in_api(server)) == {(2, 2)}
    assert len(device_names(slices_in_api(server))) == 201


def test_persistent_server_errors_surface_and_the_next_publish_recovers(server: Any, node_uid: str) -> None:
    pub, _ = publisher(server, max_attempts=3)
    server.faults.fail("POST", r"/resourceslices", status=503, count=3)
    with pytest.raises(ApiError) as failure:
        pub.publish(dgx_h100())
    assert failure.value.status == 503
    assert slices_in_api(server) == []
    assert pub.publish(dgx_h100()).created == 1  # not mistaken for "already published"


def test_invalid_slice_is_an_error_not_retried(server: Any, node_uid: str) -> None:
    pub, store = publisher(server)
    long_product = nvswitch_inventory([h100(0, product_name="x" * 65)])  # attribute strings are <= 64
    with pytest.raises(ApiError) as failure:
        pub.publish(long_product)
    assert failure.value.status == 422
    assert store.writes() == ["create"]


def test_partitionable_devices_are_published_where_the_server_keeps_counters(server: Any, node_uid: str) -> None:
    """The publisher reads the server's version and publishes the shape it accepts (counters beside their
    devices on 1.34, in slices of their own from 1.35); the pool is consistent either way."""
    pub, _ = publisher(server, partitionable=True)
    result = pub.publish(dgx_h100())
    version = server.rest().server_version()
    assert pub.rules.label in version
    slices = slices_in_api(server)
    assert pub.partitionable and result.slices == len(slices) == (8 if pub.rules.label == "1.34" else 9)
    assert pool_errors(slices, pub.rules.label) == []
    assert sum(len(s["spec"].get("sharedCounters", [])) for s in slices) == 8
    assert "gpu-0-mig-7g80gb-0-0" in device_names(slices)


def test_partitionable_falls_back_when_the_server_drops_counters(caplog: pytest.LogCaptureFixture) -> None:
    with fakes.apiserver.start(port=0, drop_partitionable_fields=True) as srv:
        pub, _ = publisher(srv, partitionable=True)
        with caplog.at_level(logging.WARNING, logger="agent.slices.publisher"):
            result = pub.publish(dgx_h100())
        assert not pub.partitionable
        assert "dropped sharedCounters" in caplog.text
        slices = slices_in_api(srv)
        assert device_names(slices) == [f"gpu-{i}" for i in range(8)]  # no unconstrained MIG placements left
        assert pools(slices) == {(result.generation, 1)}
        assert not any(s["spec"].get("sharedCounters") for s in slices)


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_run_loop_keeps_the_pool_in_place(server: Any, node_uid: str) -> None:
    pub, _ = publisher(server)
    results: list[Any] = []
    inventory: list[Inventory] = [dgx_h100()]
    stop = threading.Event()
    loop = threading.Thread(target=pub.run, args=(stop, lambda: inventory[0], 0.05, results.append))
    loop.start()
    try:
        wait_for(lambda: len(slices_in_api(server)) == 1)
        SliceApi(server.rest()).delete(f"{NODE}-gpu-nvidia-com-0")
        wait_for(lambda: len(slices_in_api(server)) == 1)
        inventory[0] = nvswitch_inventory([h100(i) for i in range(4)])
        wait_for(lambda: device_names(slices_in_api(server)) == [f"gpu-{i}" for i in range(4)])
    finally:
        stop.set()
        loop.join(timeout=5)
    assert not loop.is_alive()
    assert results and results[-1].devices == 4


def test_fake_dgx_h100_discovered_through_nvml_is_published_whole() -> None:
    from agent.nvml.discovery import discover
    from agent.nvml.session import nvml_session

    with fakes.nvml.install("dgx-h100"), nvml_session():
        inventory = discover()
    with fakes.apiserver.start(port=0, **COMBINED_COUNTERS_SERVER) as srv:
        for partitionable in (False, True):
            pub, _ = publisher(srv, partitionable=partitionable)
            result = pub.publish(inventory)  # every write is validated by the server (422 otherwise)
            slices = slices_in_api(srv)
            gpus = [
                d for s in slices for d in s["spec"].get("devices", []) if d["attributes"]["type"]["string"] == "gpu"
            ]
            minors = sorted(g.minor for g in inventory.gpus)
            assert [d["name"] for d in gpus] == [f"gpu-{m}" for m in minors]
            assert len({d["attributes"]["nvlinkDomain"]["string"] for d in gpus}) == 1
            assert all("H100" in d["attributes"]["productName"]["string"] for d in gpus)
            assert result.devices == len(device_names(slices))


@pytest.mark.parametrize("version", ["1.34", "1.35", "1.36", "1.37"])
def test_each_version_accepts_the_shape_the_publisher_picks_for_it(version: str) -> None:
    """Against the API fake playing each version (with DRAPartitionableDevices on where it is alpha): the
    partitionable pool and, on 1.36+, tainted devices are accepted as published; the other version's shape is
    refused, so the choice matters."""
    gates = {"DRAPartitionableDevices": True}
    with fakes.apiserver.start(port=0, kubernetes_version=version, feature_gates=gates) as srv:
        pub, _ = publisher(srv, partitionable=True)
        result = pub.publish(dgx_h100())
        slices = slices_in_api(srv)
        assert pub.rules.label == version and pub.partitionable  # nothing dropped, nothing refused
        assert result.slices == len(slices) and pool_errors(slices, version) == []
        assert len(device_names(slices)) == result.devices > 8 * 20

        other = rules_for("1.35" if version == "1.34" else "1.34")
        refused = []
        for wrong in build_resource_slices(dgx_h100(), "node-b", partitionable=True, rules=other):
            try:
                SliceApi(srv.rest()).create(wrong)
            except ApiError as exc:
                refused.append(exc.status)
        assert refused and set(refused) == {422}
