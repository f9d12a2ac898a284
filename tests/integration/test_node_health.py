"""An XID from NVML, end to end through the node agent: the slice stops offering the device, prepare refuses
it, and the kubelet's health stream reports it UNHEALTHY. In-process agent, API fake, kubelet fake."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

import fakes.apiserver
from agent.kubelet.health import DeviceHealth, Health
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import NvmlSource, open_nvml
from fakes.kubelet import FakeKubelet
from fakes.kubelet.kubelet import HealthWatch
from tests.integration.test_node_support import (
    DRIVER,
    NODE,
    allocate_claim,
    create_node,
    eventually,
    short_tmpdir,
)


@dataclass
class Node:
    server: fakes.apiserver.ApiServer
    api: Any
    nvml: NvmlSource
    agent: NodeAgent
    kubelet: FakeKubelet
    gpu_state: Path  # FAKE_NVML_STATE: `python -m fakes.nvml` steers these GPUs from outside

    def published(self) -> set[str]:
        return {d["name"] for s in self.server.store.objects("ResourceSlice") for d in s["spec"].get("devices", [])}


def start_node(machine: str, version: str) -> Callable[[], Iterator[Node]]:
    def fixture() -> Iterator[Node]:
        with (
            short_tmpdir("health-") as root,
            pytest.MonkeyPatch.context() as env,
        ):
            env.setenv("FAKE_NVML_STATE", str(root / "gpus.json"))
            yield from _node(machine, version, root)

    return fixture


def _node(machine: str, version: str, root: Path) -> Iterator[Node]:
    with (
        open_nvml(f"fake:{machine}") as nvml,
        fakes.apiserver.start(port=0, kubernetes_version=version) as server,
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
        agent = NodeAgent(config, nvml, rest=server.rest())
        agent.start()
        try:
            with FakeKubelet(config.kubelet_root) as kubelet:
                kubelet.wait_for_driver(DRIVER)
                yield Node(server, api, nvml, agent, kubelet, root / "gpus.json")
        finally:
            agent.shutdown()


# Servers that serve no device taints by default (DRADeviceTaints alpha): unhealthy devices are withdrawn.
@pytest.fixture(params=["1.34", "1.35"])
def dgx_h100(request: pytest.FixtureRequest) -> Iterator[Node]:
    yield from start_node("dgx-h100", request.param)()


@pytest.fixture(params=["1.34", "1.35"])
def mixed_mig(request: pytest.FixtureRequest) -> Iterator[Node]:
    yield from start_node("mixed-mig", request.param)()


@pytest.fixture(params=["1.36", "1.37"])
def dgx_h100_with_taints(request: pytest.FixtureRequest) -> Iterator[Node]:
    """A DGX H100 node whose API server serves device taints by default (DRADeviceTaints beta in 1.36)."""
    yield from start_node("dgx-h100", request.param)()


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


def fake_nvml_cli(*args: str) -> None:
    """`python -m fakes.nvml ...`, as an operator (or a test) steers the fake GPUs from another process."""
    done = subprocess.run(
        [sys.executable, "-m", "fakes.nvml", *args], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr


def pool_generation(node: Node) -> int:
    return max(s["spec"]["pool"]["generation"] for s in node.server.store.objects("ResourceSlice"))


def taints_of(node: Node, device: str) -> list[dict[str, Any]]:
    """The device's taints as published; none while it is not published."""
    found = [
        d
        for s in node.server.store.objects("ResourceSlice")
        for d in s["spec"].get("devices", [])
        if d["name"] == device
    ]
    return [t for d in found for t in d.get("taints", [])]


def test_a_critical_xid_taints_the_gpu_where_the_server_serves_taints(dgx_h100_with_taints: Node) -> None:
    """On 1.36+ an Xid leaves the GPU in the slice with NVIDIA's taint (`gpu.nvidia.com/xid` = the Xid,
    NoSchedule), so the scheduler skips it and `kubectl get resourceslice -o yaml` says why."""
    node = dgx_h100_with_taints
    for gpu, xid in ((1, 13), (3, 79)):  # 13 is an application's fault: no taint
        fake_nvml_cli("xid", "--state", str(node.gpu_state), "--gpu", str(gpu), "--xid", str(xid))
    eventually(lambda: taints_of(node, "gpu-3") != [], "gpu-3 is tainted")
    (taint,) = taints_of(node, "gpu-3")
    assert {k: taint[k] for k in ("key", "value", "effect")} == {
        "key": "gpu.nvidia.com/xid",
        "value": "79",
        "effect": "NoSchedule",
    }
    assert datetime.fromisoformat(taint["timeAdded"].replace("Z", "+00:00")).year >= 2026
    generation = pool_generation(node)
    assert taints_of(node, "gpu-1") == []
    assert node.published() == {f"gpu-{i}" for i in range(8)}  # nothing withdrawn

    time.sleep(0.5)  # a few resyncs keep the taint (and its time) as it was, without rewriting the pool
    assert taints_of(node, "gpu-3") == [taint]
    assert pool_generation(node) == generation
    result = node.kubelet.prepare(DRIVER, [ref := allocate_claim(node.api, "broken", ["gpu-3"])])[ref.uid]
    assert "gpu-3 is unhealthy" in result.error  # a claim allocated before the taint is still refused


def test_a_lost_gpu_stays_listed_with_the_gpu_lost_taint(dgx_h100_with_taints: Node) -> None:
    node = dgx_h100_with_taints
    node.nvml.fake.lose_gpu(5, xid=None)  # every call fails, no Xid first
    eventually(lambda: node.agent.inventory.gpu(5) is None, "rediscovery drops the lost GPU")
    eventually(lambda: taints_of(node, "gpu-5") != [], "gpu-5 is tainted")
    assert [(t["key"], t["effect"]) for t in taints_of(node, "gpu-5")] == [("gpu.nvidia.com/gpu-lost", "NoSchedule")]
    time.sleep(0.5)
    assert "gpu-5" in node.published()  # resyncs after rediscovery keep it listed, tainted
