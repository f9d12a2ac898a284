"""Reservation API latency (opt-in: `make bench`): one node agent's reservation server on loopback over TLS
(pinned as the arbiter connects), 8 GPUs, Reserve + Release of one GPU, without a selector and with one
(evaluated in the agent's selector worker), beside the same calls on the book in process."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest

import fakes.apiserver
from agent.allocation.allocator import Allocator, Claim, DeviceRequest
from agent.allocation.catalog import NodeUsage
from agent.allocation.selectors import CelSelectors
from agent.kube.rest import NODES
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION
from agent.reservation.node_service import NodeReservations
from agent.reservation.protocol import ReservationBook
from agent.reservation.transport import GrpcNodeClient, pinned_channel
from tests.unit.test_allocation_allocator import gpu, inventory

ROUNDS = 300
CLAIMS = {
    "no selector": Claim((DeviceRequest("g"),)),
    "one selector": Claim((DeviceRequest("g", selectors=('device.attributes["gpu.nvidia.com"].index < 4',)),)),
}


def percentiles(call: Callable[[], object]) -> str:
    call()  # warm: a selector worker starts on first use
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return f"p50 {times[len(times) // 2]:.2f} ms, p99 {times[int(len(times) * 0.99)]:.2f} ms"


@pytest.mark.bench
@pytest.mark.timeout(300)
def test_reserve_latency_over_tls_and_in_process() -> None:
    inv = inventory(*(gpu(i, "A" if i < 4 else "B") for i in range(8)))
    ids = (f"r{i}" for i in itertools.count())
    book = ReservationBook(lambda: inv, NodeUsage, Allocator(CelSelectors()), time.time, lambda: next(ids))
    with fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        rest.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}})
        node = NodeReservations(
            node_name="n",
            driver="gpu.nvidia.com",
            inventory=lambda: inv,
            prepared=lambda: (),
            unhealthy=lambda: (),
            token="bench",
            rest=rest,
        )
        node.start("127.0.0.1:0")
        try:
            annotations = rest.get(NODES, None, "n")["metadata"]["annotations"]
            start = time.perf_counter()
            channel = pinned_channel(annotations[ADDRESS_ANNOTATION], annotations[FINGERPRINT_ANNOTATION], "n")
            client = GrpcNodeClient(channel, "bench")
            client.capacity()
            print(
                f"\nconnect (certificate check, TLS handshake) and a first Capacity: "
                f"{(time.perf_counter() - start) * 1e3:.1f} ms"
            )
            print(f"Reserve + Release of one GPU of 8, {ROUNDS} rounds:")
            for label, claim in CLAIMS.items():

                def over_tls(claim: Claim = claim) -> None:
                    client.reserve("g", "ns/pod/m", claim, 30)
                    client.release(gang_id="g")

                def in_process(claim: Claim = claim) -> None:
                    book.reserve("g", "m", claim, 30)
                    book.release(gang_id="g")

                print(
                    f"  {label:12}  gRPC over TLS: {percentiles(over_tls)};  book in process: {percentiles(in_process)}"
                )
            channel.close()
        finally:
            node.stop()
