"""An XID from NVML, end to end through the node agent: the slice stops offering the device, prepare refuses
it, and the kubelet's health stream reports it UNHEALTHY. In-process agent, API fake, kubelet fake."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import fakes.apiserver
from agent.kubelet.health import DeviceHealth, Health
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import NvmlSource, open_nvml
from fakes.kubelet import FakeKubelet
from fakes.kubelet.kubelet import HealthWatch
from tests.integration.test_node_support import DRIVER, NODE, allocate_claim, create_node, short_tmpdir


@dataclass
class Node:
    server: fakes.apiserver.ApiServer
    api: Any
    nvml: NvmlSource
    agent: NodeAgent
    kubelet: FakeKubelet

    def published(self) -> set[str]:
        return {d["name"] for s in self.server.store.objects("ResourceSlice") for d in s["spec"].get("devices", [])}


def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


def start_node(machine: str) -> Callable[[], Iterator[Node]]:
    def fixture() -> Iterator[Node]:
        with (
            short_tmpdir("health-") as root,
            open_nvml(f"fake:{machine}") as nvml,
            fakes.apiserver.start(port=0) as server,
        ):
            api = server.api_client()
            create_node(api)
            config = NodeConfig(
                node_name=NODE,
                driver_name=DRIVER,
                kubelet_root=root / "kubelet",
                cdi_root=root / "cdi",
                state_dir=root / "state",
                resync_interval_s=0.2,  # a resync must not bring an unhealthy device back
            )
            agent = NodeAgent(config, nvml, api=api)
            agent.start()
            try:
                with FakeKubelet(config.kubelet_root) as kubelet:
                    kubelet.wait_for_driver(DRIVER)
                    yield Node(server, api, nvml, agent, kubelet)
            finally:
                agent.shutdown()

    return fixture


dgx_h100 = pytest.fixture(start_node("dgx-h100"))
mixed_mig = pytest.fixture(start_node("mixed-mig"))


def health_of(devices: tuple[DeviceHealth, ...], name: str) -> Health:
    return next(d.health for d in devices if d.device == name)


def next_until(watch: HealthWatch, done: Callable[[tuple[DeviceHealth, ...]], bool]) -> tuple[DeviceHealth, ...]:
    for devices in watch:
        if done(devices):
            return devices
    raise AssertionError("the health stream ended")


def test_a_critical_xid_takes_the_gpu_out_of_service(dgx_h100: Node) -> None:
    node = dgx_h100
    assert {"gpu-1", "gpu-3"} <= node.published()
    watch = node.kubelet.watch_health(DRIVER, timeout=15)
    try:
        first = next(watch)
        assert {d.health for d in first} == {Health.HEALTHY} and len(first) == 8

        node.nvml.fake.inject_xid(1, 13)  # an application's fault: the GPU stays in service
        node.nvml.fake.inject_xid(3, 79)
        eventually(lambda: "gpu-3" not in node.published(), "gpu-3 leaves the ResourceSlice")
        assert node.published() == {f"gpu-{i}" for i in range(8)} - {"gpu-3"}

        devices = next_until(watch, lambda ds: health_of(ds, "gpu-3") is Health.UNHEALTHY)
        assert {d.device for d in devices if d.health is Health.UNHEALTHY} == {"gpu-3"}
        assert len(devices) == 8  # the unhealthy device stays in the stream, so pods holding it see why
    finally:
        watch.cancel()

    broken = allocate_claim(node.api, "on-broken-gpu", ["gpu-3"])
    fine = allocate_claim(node.api, "on-good-gpu", ["gpu-1"])
    results = node.kubelet.prepare(DRIVER, [broken, fine])
    assert "gpu-3 is unhealthy" in results[broken.uid].error
    assert results[broken.uid].devices == ()
    assert results[fine.uid].error == ""

    time.sleep(0.5)  # a few resyncs: they must keep the device out
    assert "gpu-3" not in node.published()


def test_a_lost_gpu_stays_unhealthy_after_rediscovery(dgx_h100: Node) -> None:
    node = dgx_h100
    node.nvml.fake.lose_gpu(5)  # Xid 79, then every call on it fails
    eventually(lambda: "gpu-5" not in node.published(), "gpu-5 leaves the ResourceSlice")
    # rediscovery lists the GPU as unavailable; the health stream keeps reporting it, UNHEALTHY
    eventually(lambda: node.agent.inventory.gpu(5) is None, "rediscovery drops the lost GPU")
    devices = node.agent.health.snapshot().devices
    assert health_of(devices, "gpu-5") is Health.UNHEALTHY
    result = node.kubelet.prepare(DRIVER, [ref := allocate_claim(node.api, "lost", ["gpu-5"])])[ref.uid]
    assert "gpu-5" in result.error


def test_a_mig_scoped_xid_takes_out_only_that_mig_device(mixed_mig: Node) -> None:
    node = mixed_mig
    migs = node.agent.inventory.mig_devices_of(0)
    target, sibling = migs[0], migs[1]

    def name(m: Any) -> str:
        return f"gpu-0-mig-{m.profile.replace('.', '')}-{m.gi_profile_id}-{m.placement.start}"

    assert {name(target), name(sibling)} <= node.published()
    node.nvml.fake.inject_xid(
        0, 94, gpu_instance_id=target.gpu_instance_id, compute_instance_id=target.compute_instance_id
    )
    eventually(lambda: name(target) not in node.published(), "the MIG device leaves the ResourceSlice")
    assert name(sibling) in node.published()
    unhealthy = {d.device for d in node.agent.health.snapshot().devices if d.health is Health.UNHEALTHY}
    assert unhealthy == {name(target)}
    results = node.kubelet.prepare(
        DRIVER,
        [a := allocate_claim(node.api, "a", [name(target)]), b := allocate_claim(node.api, "b", [name(sibling)])],
    )
    assert "unhealthy" in results[a.uid].error
    assert results[b.uid].error == ""
