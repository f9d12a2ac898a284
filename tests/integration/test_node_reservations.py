"""The node agent's reservation API against the API server fake: advertised on the Node, authenticated, and
counting devices allocated in ResourceClaims, prepared on the node, and reserved."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from agent.allocation.allocator import Claim, DeviceRequest, NoFit
from agent.arbiter.names import ADDRESS_ANNOTATION
from agent.arbiter.node_service import NodeReservations, TokenFileError, read_token, split_address
from agent.arbiter.reservation import NodeUnavailable, Unauthenticated
from agent.arbiter.reservation_grpc import GrpcNodeClient
from agent.kube.rest import NODES, RESOURCE_CLAIMS, Rest
from tests.unit.test_allocation_allocator import gpu, inventory
from tests.unit.test_reservation_book import TOKEN

apiserver = pytest.importorskip("fakes.apiserver")

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"


@pytest.fixture
def rest() -> Iterator[Rest]:
    with apiserver.start(port=0) as server:
        r = Rest(server.api_client())
        r.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield r


@pytest.fixture
def node(rest: Rest) -> Iterator[tuple[NodeReservations, list[str]]]:
    prepared: list[str] = []
    inv = inventory(*(gpu(i, "A") for i in range(4)))
    service = NodeReservations(node_name=NODE, driver=DRIVER, inventory=lambda: inv, prepared=lambda: prepared,
                               unhealthy=lambda: (), token=TOKEN, rest=rest)
    service.start("127.0.0.1:0")
    yield service, prepared
    service.stop()


def allocated_claim(rest: Rest, name: str, devices: list[str], node: str = NODE) -> None:
    claim = rest.create(RESOURCE_CLAIMS, "default", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                                      "count": len(devices)}}]}},
    })
    claim["status"] = {"allocation": {
        "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": d} for d in devices]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]},
    }}
    rest.replace(RESOURCE_CLAIMS, claim, "status")


def gpus(n: int) -> Claim:
    return Claim((DeviceRequest("gpus", count=n),))


def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_address_is_advertised_on_the_node_and_serves_reservations(
        rest: Rest, node: tuple[NodeReservations, list[str]]) -> None:
    service, _ = node
    address = rest.get(NODES, None, NODE)["metadata"]["annotations"][ADDRESS_ANNOTATION]
    assert address == f"127.0.0.1:{service.port}"
    with grpc.insecure_channel(address) as channel:
        r = GrpcNodeClient(channel, TOKEN).reserve("g", "m", gpus(4), 30)
        assert len(r.fit.devices["gpus"]) == 4


def test_no_reservation_without_the_token(node: tuple[NodeReservations, list[str]]) -> None:
    service, _ = node
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel, \
            pytest.raises(Unauthenticated):  # tried: a wrong token
        GrpcNodeClient(channel, "not-the-token").reserve("g", "m", gpus(1), 30)
    assert service.book.live() == []


def test_allocated_prepared_and_reserved_devices_are_all_taken(
        rest: Rest, node: tuple[NodeReservations, list[str]]) -> None:
    service, prepared = node
    allocated_claim(rest, "held", ["gpu-0"])
    allocated_claim(rest, "elsewhere", ["gpu-1"], node="other-node")  # another node's pool: not ours
    eventually(lambda: "gpu-0" in service.usage().allocated)
    prepared.append("gpu-3")  # prepared for a terminating pod whose claim is already deallocated
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        client = GrpcNodeClient(channel, TOKEN)
        with pytest.raises(NoFit):  # tried: three GPUs where gpu-0 is allocated and gpu-3 prepared
            client.reserve("g", "m", gpus(3), 30)
        r = client.reserve("g", "m", gpus(2), 30)
        assert sorted(r.fit.devices["gpus"]) == ["gpu-1", "gpu-2"]
        with pytest.raises(NoFit):  # tried: one more GPU while gpu-1 and gpu-2 are reserved
            client.reserve("h", "m", gpus(1), 30)
        assert client.release(gang_id="g") == 1
        assert len(client.reserve("h", "m", gpus(2), 30).fit.devices["gpus"]) == 2


def test_a_confirmed_reservation_holds_until_its_claim_is_seen_then_the_claim_counts(
        rest: Rest, node: tuple[NodeReservations, list[str]]) -> None:
    service, _ = node
    now = [1000.0]
    service.book._clock = lambda: now[0]  # type: ignore[method-assign]
    r = service.book.reserve("g", "m", gpus(4), 10)
    service.book.confirm(r.id)
    now[0] += 30  # past the TTL: a confirmed reservation stays
    assert [x.id for x in service.book.live()] == [r.id]
    allocated_claim(rest, "committed", list(r.fit.devices["gpus"]))
    now[0] += 60  # past the confirmed hold: the claim now keeps the devices taken
    assert service.book.live() == []
    eventually(lambda: len(service.usage().allocated) == 4)
    with pytest.raises(NoFit):
        service.book.reserve("h", "m", gpus(1), 10)


def test_an_unreachable_node_is_node_unavailable() -> None:
    with grpc.insecure_channel("127.0.0.1:1") as channel, \
            pytest.raises(NodeUnavailable):  # tried: nothing listens on the port
        GrpcNodeClient(channel, TOKEN, timeout_s=0.5).capacity()


@pytest.mark.parametrize(("text", "error"), [
    ("", "empty"), ("   \n", "empty"),
], ids=["empty", "whitespace"])
def test_an_empty_token_file_is_refused(tmp_path: Any, text: str, error: str) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    with pytest.raises(TokenFileError, match=error):
        read_token(path)
    with pytest.raises(TokenFileError, match="cannot read"):  # tried: a file that does not exist
        read_token(tmp_path / "missing")
    assert read_token(_write(tmp_path / "ok", " tok\n")) == "tok"


def _write(path: Any, text: str) -> Any:
    path.write_text(text)
    return path


@pytest.mark.parametrize("address", ["nohost", "host:", "host:99999", "host:port"])
def test_a_malformed_address_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address(address)


def test_consumable_capacity_shares_take_their_fraction_and_keep_the_gpu_from_whole_claims(
        rest: Rest, node: tuple[NodeReservations, list[str]]) -> None:
    service, _ = node
    memory = service._inventory().gpus[0].memory_bytes
    for i in range(9):
        claim = rest.create(RESOURCE_CLAIMS, "default", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": f"share-{i}"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com", "capacity": {"requests": {"memory": "8Gi"}}}}]}},
        })
        claim["status"] = {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0",
                                     "shareID": f"00000000-0000-4000-8000-00000000000{i}",
                                     "consumedCapacity": {"memory": "8Gi"}}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
        }}
        rest.replace(RESOURCE_CLAIMS, claim, "status")
    per_share = -(-8 * (1 << 30) * 1000 // memory)
    eventually(lambda: service.usage().shared_milli.get("gpu-0") == 9 * per_share)
    assert "gpu-0" not in service.usage().allocated
    with pytest.raises(NoFit):  # tried: every GPU whole while gpu-0 holds shares
        service.book.reserve("g", "m", gpus(4), 10)
    assert sorted(service.book.reserve("g", "m", gpus(3), 10).fit.devices["gpus"]) == ["gpu-1", "gpu-2", "gpu-3"]
