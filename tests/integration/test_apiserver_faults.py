"""Patch types over HTTP, injected faults and transport latency of the API fake."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest
from kubernetes import client
from kubernetes.client import ApiException

import fakes.apiserver
from fakes.apiserver import ApiServer


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fakes.apiserver.start() as s:
        yield s


@pytest.fixture
def core(server: ApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(server.api_client())


POD = {
    "metadata": {"name": "p", "labels": {"a": "1"}},
    "spec": {"containers": [{"name": "main", "image": "v1"}, {"name": "side", "image": "s1"}]},
}


def test_each_patch_type_over_http(core: client.CoreV1Api) -> None:
    core.create_namespaced_pod("default", POD)
    # A dict body goes out as a strategic merge patch: containers merge by name.
    core.patch_namespaced_pod("p", "default", {"spec": {"containers": [{"name": "main", "image": "v2"}]}})
    pod = core.read_namespaced_pod("p", "default")
    assert [(c.name, c.image) for c in pod.spec.containers] == [("main", "v2"), ("side", "s1")]
    # A merge patch: null deletes a key.
    core.patch_namespaced_pod(
        "p", "default", {"metadata": {"labels": {"a": None, "b": "2"}}}, _content_type="application/merge-patch+json"
    )
    assert core.read_namespaced_pod("p", "default").metadata.labels == {"b": "2"}
    # A list body is a JSON patch; a failing test op leaves the object as it was.
    with pytest.raises(ApiException) as err:
        core.patch_namespaced_pod(
            "p",
            "default",
            [
                {"op": "replace", "path": "/spec/containers/1/image", "value": "s2"},
                {"op": "test", "path": "/metadata/labels/b", "value": "wrong"},
            ],
        )
    assert err.value.status == 422
    assert core.read_namespaced_pod("p", "default").spec.containers[1].image == "s1"
    core.patch_namespaced_pod(
        "p",
        "default",
        [
            {"op": "test", "path": "/metadata/labels/b", "value": "2"},
            {"op": "replace", "path": "/spec/containers/1/image", "value": "s2"},
        ],
    )
    assert core.read_namespaced_pod("p", "default").spec.containers[1].image == "s2"


def test_patch_with_stale_resource_version_conflicts(core: client.CoreV1Api) -> None:
    created = core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}, "data": {"k": "1"}})
    core.patch_namespaced_config_map("cm", "default", {"data": {"k": "2"}})
    with pytest.raises(ApiException) as err:  # a patch pinned to the first version
        core.patch_namespaced_config_map(
            "cm", "default", {"metadata": {"resourceVersion": created.metadata.resource_version}, "data": {"k": "3"}}
        )
    assert err.value.status == 409


def test_injected_failures_count_down(server: ApiServer, core: client.CoreV1Api) -> None:
    server.faults.fail("GET", r"/api/v1/nodes$", 503, count=2)
    for _ in range(2):
        with pytest.raises(ApiException) as err:
            core.list_node()
        assert err.value.status == 503 and json.loads(err.value.body)["reason"] == "ServiceUnavailable"
    assert core.list_node().items == []
    server.faults.fail("*", r"/resourceslices", 500, count=1)
    with pytest.raises(ApiException) as err:
        client.ResourceV1Api(server.api_client()).list_resource_slice()
    assert err.value.status == 500
    assert core.list_node().items == []  # other paths are not affected


def test_injected_latency(server: ApiServer, core: client.CoreV1Api) -> None:
    server.faults.latency(0.2)
    start = time.perf_counter()
    core.list_node()
    assert time.perf_counter() - start >= 0.2
    server.faults.latency(0)
    start = time.perf_counter()
    core.list_node()
    assert time.perf_counter() - start < 0.1


def test_loopback_get_is_not_held_back_by_nagle(core: client.CoreV1Api) -> None:
    core.create_node({"metadata": {"name": "node-a"}})
    for _ in range(10):
        assert core.read_node("node-a", _preload_content=False).data
    rounds = 100
    start = time.perf_counter()
    for _ in range(rounds):
        assert core.read_node("node-a", _preload_content=False).data
    per_get = (time.perf_counter() - start) / rounds
    # With headers and body in separate sends a GET costs ~40 ms (Nagle + delayed ACK); here well under 10 ms.
    assert per_get < 0.01, f"{per_get * 1000:.2f} ms per GET"
