"""Partitionable MIG devices end to end: the node agent on fake:dgx-h100 (MIG mode on for GPU 1, no instances)
offers every placement; a claim allocated one gets it created at prepare and destroyed at unprepare. In-process
agent, API fake, kubelet fake over the real sockets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pynvml
import pytest
import yaml

import fakes.apiserver
from agent.claims import cdi
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import NvmlSource, open_nvml
from fakes.kubelet import FakeKubelet
from tests.integration.test_node_support import (
    DRIVER,
    NODE,
    allocate_claim,
    cdi_file,
    create_node,
    eventually,
    short_tmpdir,
)

PLACEMENT = "gpu-1-mig-1g10gb-19-3"

# The agent publishes counters beside the devices that consume them (the 1.34 shape), which 1.35+ rejects: these
# tests run against 1.34 with DRAPartitionableDevices on until the agent publishes the split shape (issue 8).
COMBINED_COUNTERS_SERVER: dict = {"kubernetes_version": "1.34", "feature_gates": {"DRAPartitionableDevices": True}}


@dataclass
class Node:
    server: fakes.apiserver.ApiServer
    api: Any
    nvml: NvmlSource
    agent: NodeAgent
    kubelet: FakeKubelet
    config: NodeConfig

    def published(self) -> dict[str, dict[str, Any]]:
        return {d["name"]: d for s in self.server.store.objects("ResourceSlice") for d in s["spec"].get("devices", [])}


@pytest.fixture
def node() -> Iterator[Node]:
    with (
        short_tmpdir("dynmig-") as root,
        open_nvml("fake:dgx-h100") as nvml,
        fakes.apiserver.start(port=0, **COMBINED_COUNTERS_SERVER) as server,
    ):
        h = pynvml.nvmlDeviceGetHandleByIndex(1)
        assert pynvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == 0
        api = server.api_client()
        create_node(api)
        config = NodeConfig(
            node_name=NODE,
            driver_name=DRIVER,
            kubelet_root=root / "kubelet",
            cdi_root=root / "cdi",
            state_dir=root / "state",
            partitionable=True,
            resync_interval_s=3600,  # slices must follow a create/destroy at once, not at the next resync
            health_events=False,
        )
        agent = NodeAgent(config, nvml, rest=server.rest())
        agent.start()
        try:
            with FakeKubelet(config.kubelet_root) as kubelet:
                kubelet.wait_for_driver(DRIVER)
                yield Node(server, api, nvml, agent, kubelet, config)
        finally:
            agent.shutdown()


def test_a_claim_for_a_placement_gets_the_mig_device_created_then_destroyed(node: Node) -> None:
    offered = node.published()[PLACEMENT]
    assert "uuid" not in offered["attributes"]  # a placement, not a device yet
    gpu = node.nvml.fake.gpus[1]
    assert not gpu.gpu_instances

    ref = allocate_claim(node.api, "one-mig", [PLACEMENT])
    result = node.kubelet.prepare(DRIVER, [ref])[ref.uid]
    assert result.error == ""
    assert [d.device_name for d in result.devices] == [PLACEMENT]

    [mig] = [m for m in node.nvml.discover().mig_devices_of(1)]  # it exists in NVML now
    assert (mig.profile, mig.placement.start) == ("1g.10gb", 3)
    spec = yaml.safe_load(cdi_file(node.config.cdi_root, ref).read_text())
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]  # the spec's own nodes name the device
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes == list(cdi.mig_device_nodes(1, mig.gpu_instance_id, mig.compute_instance_id, cdi.MigCaps()))

    assert [m.uuid for m in node.agent.inventory.mig_devices_of(1)] == [mig.uuid]  # re-discovered at once
    eventually(
        lambda: node.published().get(PLACEMENT, {}).get("attributes", {}).get("uuid") == {"string": mig.uuid},
        "the slice shows the created device with its uuid",
    )
    assert "gpu-1" not in node.published()  # a GPU instance exists: the whole GPU is no longer offered
    assert "gpu-1-mig-1g10gb-19-0" in node.published()  # other free placements still are

    assert node.kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
    assert not gpu.gpu_instances  # destroyed in NVML
    assert not cdi_file(node.config.cdi_root, ref).exists()
    assert node.agent.inventory.mig_devices_of(1) == ()
    eventually(lambda: "gpu-1" in node.published(), "the whole GPU is offered again")
    assert "uuid" not in node.published()[PLACEMENT]["attributes"]


def test_a_placement_overlapping_a_created_device_fails_that_claim_only(node: Node) -> None:
    first = allocate_claim(node.api, "three-g", ["gpu-1-mig-3g40gb-9-4"])
    assert node.kubelet.prepare(DRIVER, [first])[first.uid].error == ""
    late = allocate_claim(node.api, "stale-allocation", ["gpu-1-mig-1g10gb-19-5"])
    full = allocate_claim(node.api, "whole-gpu", ["gpu-2"])
    results = node.kubelet.prepare(DRIVER, [late, full])
    assert "placement taken" in results[late.uid].error
    assert results[full.uid].error == ""
    assert [gi.start for gi in node.nvml.fake.gpus[1].gpu_instances.values()] == [4]
