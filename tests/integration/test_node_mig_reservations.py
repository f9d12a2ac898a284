"""A MIG relabel beside the arbiter's reservation API, in-process on fake:dgx-h100: the GPUs that change stop
being offered for reservations at once, and a reservation already holding one of them holds the relabel."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

import fakes.apiserver
from agent.allocation.allocator import Claim, DeviceRequest
from agent.migconfig.files import load_mig_configs
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import open_nvml
from tests.integration.test_node_support import DRIVER, NODE, create_node, eventually, short_tmpdir

STATE = "nvidia.com/mig.config.state"


@pytest.fixture
def node() -> Iterator[tuple[NodeAgent, fakes.apiserver.ApiServer]]:
    with short_tmpdir("migres-") as root, open_nvml("fake:dgx-h100") as nvml, fakes.apiserver.start(port=0) as server:
        api = server.api_client()
        create_node(api)
        config = NodeConfig(
            node_name=NODE,
            driver_name=DRIVER,
            kubelet_root=root / "kubelet",
            cdi_root=root / "cdi",
            state_dir=root / "state",
            resync_interval_s=3600,
            health_events=False,
            reservation_address="127.0.0.1:0",
            mig_configs=load_mig_configs(None),
        )
        agent = NodeAgent(config, nvml, rest=server.rest())
        agent.start()
        try:
            yield agent, server
        finally:
            agent.shutdown()


def test_a_relabel_withdraws_its_gpus_from_reservations_and_waits_for_one_held(
    node: tuple[NodeAgent, fakes.apiserver.ApiServer],
) -> None:
    agent, server = node
    assert agent.reservations is not None
    book = agent.reservations.book
    held = book.reserve("gang-a", "m0", Claim((DeviceRequest("gpus", count=1),)), ttl_seconds=60)
    assert book.capacity().free_gpus_by_model == {"NVIDIA H100 80GB HBM3": 7}
    client.CoreV1Api(server.api_client()).patch_node(
        NODE, {"metadata": {"labels": {"nvidia.com/mig.config": "all-1g.10gb"}}}
    )

    def events(reason: str) -> list[dict[str, Any]]:
        return [e for e in server.store.objects("Event") if e["reason"] == reason]

    eventually(lambda: bool(events("MigConfigWaiting")), "a MigConfigWaiting Event", 15.0)
    assert "reservation of gang gang-a" in events("MigConfigWaiting")[-1]["message"]
    assert book.capacity().free_gpus_by_model == {}  # nothing more may be reserved on the changing GPUs
    time.sleep(1.5)
    assert server.store.get("Node", NODE)["metadata"]["labels"][STATE] == "pending"
    assert not any(m for m in agent.inventory.mig_devices)
    assert book.release(held.id) == 1
    eventually(lambda: server.store.get("Node", NODE)["metadata"]["labels"].get(STATE) == "success", "success", 15.0)
    assert book.capacity().free_mig_placements == {"1g.10gb": 56}
