"""What the node agent says about state it cannot trust: world-writable driver files every container mounts
(issue 33 item 13) and a claim record that cannot be read (item 14), each as a log line, a Warning Event on
the Node and a metric, with the agent serving the other claims as before. In-process agent, fake NVML and API."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

import fakes.apiserver
from agent.claims.checkpoint import CheckpointStore
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import open_nvml
from fakes.kubelet import FakeKubelet
from fakes.nvml.binaries import install_driver_root
from tests.integration.test_node_support import DRIVER, MACHINE, NODE, allocate_claim, create_node, short_tmpdir


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        create_node(srv.api_client())
        yield srv


def node_events(server: fakes.apiserver.ApiServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in server.store.objects("Event") if e["reason"] == reason and e["involvedObject"]["kind"] == "Node"]


def config(root: pathlib.Path) -> NodeConfig:
    return NodeConfig(
        NODE,
        DRIVER,
        root / "kubelet",
        root / "cdi",
        root / "state",
        driver_root=root / "driver-root",
        host_driver_root=str(root / "driver-root"),
        health_events=False,
    )


def test_world_writable_driver_files_are_told_on_the_node_and_counted(server: fakes.apiserver.ApiServer) -> None:
    # Tried: the driver's libcuda and nvidia-smi made writable by everyone on the host. Before, every claim's
    # spec mounted them into its containers and nothing said so.
    with short_tmpdir("ww-") as root, open_nvml(MACHINE) as nvml:
        install_driver_root(root / "driver-root")
        writable = [next((root / "driver-root").rglob("libcuda.so.5*")), root / "driver-root/usr/bin/nvidia-smi"]
        for path in writable:
            path.chmod(0o777)
        agent = NodeAgent(config(root), nvml, rest=server.rest())
        assert agent.metrics.registry.get_sample_value("gpu_dra_driver_files_world_writable") == 2
        agent.start()
        try:
            assert agent._events.flush()
            [event] = node_events(server, "DriverFilesWorldWritable")
            assert event["type"] == "Warning" and event["involvedObject"]["name"] == NODE
            assert "2 driver file(s)" in event["message"] and "usr/bin/nvidia-smi" in event["message"]
        finally:
            agent.shutdown()


def test_a_corrupt_claim_record_fences_that_claim_and_the_node_goes_on(server: fakes.apiserver.ApiServer) -> None:
    # Tried: one prepared claim's record damaged while the agent was down. Before, the restarted agent failed
    # every prepare on the node with the checksum error.
    with short_tmpdir("fence-") as root, open_nvml(MACHINE) as nvml:
        install_driver_root(root / "driver-root")
        api = server.api_client()
        held, other, blocked = (
            allocate_claim(api, name, [d]) for name, d in (("held", "gpu-0"), ("other", "gpu-1"), ("blocked", "gpu-0"))
        )
        first = NodeAgent(config(root), nvml, rest=server.rest())
        assert first.preparer.prepare([held])[held.uid].error == ""
        record = CheckpointStore(root / "state").record_path(held.uid)
        record.write_bytes(record.read_bytes().replace(b'"state":"PrepareCompleted"', b'"state":"PrepareStarted"'))
        agent = NodeAgent(config(root), nvml, rest=server.rest())
        agent.start()
        try:
            with FakeKubelet(agent.config.kubelet_root) as kubelet:
                kubelet.wait_for_driver(DRIVER)
                results = kubelet.prepare(DRIVER, [held, other, blocked])
                assert results[other.uid].error == ""
                assert "checksum mismatch" in results[held.uid].error and "fenced" in results[held.uid].error
                assert results[blocked.uid].error.startswith("device gpu-0 stays held")
                assert "not unprepared until then" in kubelet.unprepare(DRIVER, [held])[held.uid]
            assert agent.metrics.registry.get_sample_value("gpu_dra_fenced_claim_records") == 1
            assert agent._events.flush()
            [event] = node_events(server, "ClaimRecordFenced")
            assert event["type"] == "Warning" and str(record) in event["message"]
        finally:
            agent.shutdown()
