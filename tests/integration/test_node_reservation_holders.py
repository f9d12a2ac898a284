"""Issue 17 item 5 on a whole node agent (fake:dgx-h100, API fake, kubelet fake over the real sockets): while the
arbiter's reservation holds a GPU, the kubelet's prepare of another claim allocated that GPU is refused, and the
reservation's Confirm fails; the reservation's own claim prepares."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import fakes.apiserver
from agent.allocation.allocator import Claim, DeviceRequest
from agent.kube.rest import NODES, Rest
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import open_nvml
from agent.reservation.protocol import ReservationLost
from agent.reservation.transport import GrpcNodeClient, pinned_channel
from fakes.cluster import arbiter_token, wait_for
from fakes.kubelet import FakeKubelet
from tests.integration.test_node_support import DRIVER, NODE, allocate_claim, create_node, short_tmpdir

GPU0 = Claim((DeviceRequest("gpus", selectors=('device.attributes["gpu.nvidia.com"].index == 0',)),))


@dataclass
class Node:
    api: Any
    rest: Rest
    agent: NodeAgent
    kubelet: FakeKubelet

    def client(self) -> tuple[Any, GrpcNodeClient]:
        annotations = self.rest.get(NODES, None, NODE)["metadata"]["annotations"]
        channel = pinned_channel(annotations[ADDRESS_ANNOTATION], annotations[FINGERPRINT_ANNOTATION], NODE)
        return channel, GrpcNodeClient(channel, arbiter_token(self.rest))


@pytest.fixture
def node() -> Iterator[Node]:
    with short_tmpdir("reshold-") as root, open_nvml("fake:dgx-h100") as nvml, fakes.apiserver.start(port=0) as server:
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
        )
        agent = NodeAgent(config, nvml, rest=server.rest())
        agent.start()
        try:
            with FakeKubelet(config.kubelet_root) as kubelet:
                kubelet.wait_for_driver(DRIVER)
                yield Node(api, server.rest(), agent, kubelet)
        finally:
            agent.shutdown()


def test_a_reserved_gpu_is_refused_to_another_claims_prepare_and_confirm_then_fails(node: Node) -> None:
    channel, client = node.client()
    with channel:
        r = client.reserve("g", "default/trainer-0/trainer-0-gpus", GPU0, 30)
        assert r.fit.all_devices == {"gpu-0"}
        # kube-scheduler, not seeing the reservation, allocates gpu-0 to another claim; the kubelet prepares it
        intruder = allocate_claim(node.api, "intruder", ["gpu-0"])
        result = node.kubelet.prepare(DRIVER, [intruder])[intruder.uid]
        assert result.error == (
            "device gpu-0 is reserved for another claim: reservation "
            f"{r.id} (gang g, member default/trainer-0/trainer-0-gpus)"
        )
        reservations = node.agent.reservations
        assert reservations is not None
        wait_for(lambda: "gpu-0" in reservations.holders(), what="the claim informer sees the intruder")
        with pytest.raises(ReservationLost, match="gpu-0 \\(held by ResourceClaim default/intruder\\)"):
            client.confirm(r.id)
        # the reservation is gone: now the intruder's prepare goes through
        assert node.kubelet.prepare(DRIVER, [intruder])[intruder.uid].error == ""


def test_the_reservations_own_claim_prepares(node: Node) -> None:
    channel, client = node.client()
    with channel:
        r = client.reserve("g", "default/trainer-0/trainer-0-gpus", GPU0, 30)
        own = allocate_claim(node.api, "trainer-0-gpus", ["gpu-0"])
        assert node.kubelet.prepare(DRIVER, [own])[own.uid].error == ""
        reservations = node.agent.reservations
        assert reservations is not None
        wait_for(lambda: "gpu-0" in reservations.holders(), what="the claim informer sees the claim")
        client.confirm(r.id)  # only its own claim holds gpu-0
