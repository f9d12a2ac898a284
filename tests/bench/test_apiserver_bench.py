"""Opt-in: request latency of the API fake through the official client on loopback."""

from __future__ import annotations

import statistics
import time

import pytest
from kubernetes import client

import fakes.apiserver


def _timed(fn, rounds: int) -> list[float]:
    for _ in range(20):
        fn()
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        out.append((time.perf_counter() - start) * 1000)
    return sorted(out)


@pytest.mark.bench
def test_apiserver_request_latency() -> None:
    with fakes.apiserver.start() as server:
        core = client.CoreV1Api(server.api_client())
        resource = client.ResourceV1Api(server.api_client())
        core.create_node({"metadata": {"name": "node-a"}})
        devices = [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(128)]
        body = {
            "metadata": {"name": "s"},
            "spec": {
                "driver": "gpu.nvidia.com",
                "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
        cases = {
            "GET node (raw)": lambda: core.read_node("node-a", _preload_content=False).data,
            "GET node (deserialized)": lambda: core.read_node("node-a"),
            "PATCH node labels": lambda: (
                core.patch_node(
                    "node-a", {"metadata": {"labels": {"t": str(time.time_ns())}}}, _preload_content=False
                ).data
            ),
        }
        for name, fn in cases.items():
            ms = _timed(fn, 500)
            print(f"{name}: p50 {statistics.median(ms):.3f} ms, p99 {ms[int(len(ms) * 0.99)]:.3f} ms")
        counter = iter(range(10**6))

        def create_delete() -> None:
            body["metadata"]["name"] = f"s{next(counter)}"
            assert resource.create_resource_slice(body, _preload_content=False).status == 201
            assert resource.delete_resource_slice(body["metadata"]["name"], _preload_content=False).status == 200

        ms = _timed(create_delete, 100)
        print(
            f"create+delete 128-device ResourceSlice: p50 {statistics.median(ms):.3f} ms, "
            f"p99 {ms[int(len(ms) * 0.99)]:.3f} ms"
        )
