"""The reservation protocol over a real gRPC server on a unix socket: auth, reserve, confirm, release, errors."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from agent._proto import arbiter_pb2 as pb
from agent._proto import arbiter_pb2_grpc as pb_grpc
from agent.allocation.allocator import Claim, DeviceRequest, NoFit
from agent.reservation.protocol import (
    GangCoordinator,
    MemberPlacement,
    NodeAllocatorService,
    ReservationLost,
    UnknownReservation,
)
from agent.reservation.transport import GrpcNodeClient, TokenInterceptor, add_to_server
from tests.unit.test_reservation_book import TOKEN, Clock, book

AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def endpoint(tmp_path: pathlib.Path) -> Iterator[tuple[str, Clock]]:
    clock = Clock()
    service = NodeAllocatorService(book(4, clock), TOKEN)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenInterceptor(service)])
    add_to_server(service, server)
    address = f"unix://{tmp_path}/arbiter.sock"
    server.add_insecure_port(address)
    server.start()
    yield address, clock
    server.stop(None)


def test_reserve_confirm_release_and_capacity_over_grpc(endpoint: tuple[str, Clock]) -> None:
    address, clock = endpoint
    with grpc.insecure_channel(address) as channel:
        client = GrpcNodeClient(channel, TOKEN)
        r = client.reserve("g", "ns/pod/m0", Claim((DeviceRequest("gpus", count=3),)), 30)
        assert len(r.fit.devices["gpus"]) == 3 and r.expires_at == clock.now + 30
        assert client.capacity().free_gpus_by_model == {"NVIDIA H100 80GB HBM3": 1}
        with pytest.raises(NoFit):  # tried: two GPUs where one is left -> RESOURCE_EXHAUSTED
            client.reserve("h", "ns/pod/m0", Claim((DeviceRequest("gpus", count=2),)), 30)
        client.confirm(r.id)
        assert client.release(gang_id="g") == 1
        with pytest.raises(UnknownReservation):  # tried: confirming a released reservation -> NOT_FOUND
            client.confirm(r.id)
        shared = client.reserve("s", "ns/pod/m0", Claim((DeviceRequest("s", gpu_milli=250),)), 30)
        assert list(shared.fit.shared_milli.values()) == [250]


def test_gang_over_grpc_commits(endpoint: tuple[str, Clock]) -> None:
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        coord = GangCoordinator({"n1": GrpcNodeClient(channel, TOKEN)})
        out = coord.place(
            "g",
            [
                MemberPlacement("ns/pod/a", "n1", Claim((DeviceRequest("r", count=2),))),
                MemberPlacement("ns/pod/b", "n1", Claim((DeviceRequest("r", count=2),))),
            ],
            30,
        )
        assert out.committed
        failed = coord.place("h", [MemberPlacement("ns/pod/a", "n1", Claim((DeviceRequest("r"),)))], 30)
        assert not failed.committed


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)])
def test_calls_without_the_right_bearer_token_are_unauthenticated(
    endpoint: tuple[str, Clock], metadata: tuple[tuple[str, str], ...]
) -> None:
    address, _ = endpoint  # tried: no metadata, a wrong token, the token without the Bearer scheme
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        req = pb.ReserveRequest(
            gang_id="g",
            member="ns/pod/m",
            ttl_seconds=10,
            requests=[pb.DeviceRequest(name="r", device_class="gpu.nvidia.com", count=1)],
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(req, metadata=metadata, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            stub.Capacity(pb.CapacityRequest(), metadata=metadata, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_bad_request_is_invalid_argument(endpoint: tuple[str, Clock]) -> None:
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        req = pb.ReserveRequest(
            gang_id="g",
            member="ns/pod/m",
            ttl_seconds=10,
            requests=[pb.DeviceRequest(name="r", device_class="tpu.example.com", count=1)],
        )
        with pytest.raises(grpc.RpcError) as err:  # tried: an unknown device class
            stub.Reserve(req, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "device class" in (err.value.details() or "")


def test_a_reserved_device_the_node_names_unlike_its_slices_is_refused() -> None:
    from agent.devices.names import InvalidDeviceName
    from agent.reservation.transport import reservation_from_pb

    # Tried: a node answering gpu-01 for gpu-1; committing it would allocate a device no slice publishes.
    answer = pb.ReserveResponse(reservation_id="r1", devices=[pb.ReservedDevice(request="r", device="gpu-01")])
    with pytest.raises(InvalidDeviceName, match="gpu-01"):
        reservation_from_pb(answer, "g", "ns/pod/m0")
    good = pb.ReserveResponse(reservation_id="r1", devices=[pb.ReservedDevice(request="r", device="gpu-1")])
    assert reservation_from_pb(good, "g", "ns/pod/m0").fit.devices == {"r": ("gpu-1",)}


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), -float("inf"), 0.0, -1.0, 1e9, 601.0])
def test_a_ttl_that_never_expires_or_is_absurd_is_invalid_argument(endpoint: tuple[str, Clock], ttl: float) -> None:
    """Tried: NaN and infinity were accepted and held the devices for good (NaN never compares expired)."""
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        req = pb.ReserveRequest(
            gang_id="g",
            member="ns/pod/m",
            ttl_seconds=ttl,
            requests=[pb.DeviceRequest(name="r", device_class="gpu.nvidia.com", count=1)],
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(req, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ttl_seconds must be more than 0 and at most 600" in (err.value.details() or "")
        # nothing is held: the whole node is still free
        ok = pb.ReserveRequest(
            gang_id="g2",
            member="ns/pod/m",
            ttl_seconds=10,
            requests=[pb.DeviceRequest(name="r", device_class="gpu.nvidia.com", count=4)],
        )
        assert stub.Reserve(ok, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5).reservation_id


def reserve_request(*requests: pb.DeviceRequest, ttl: float = 10) -> pb.ReserveRequest:
    return pb.ReserveRequest(gang_id="g", member="ns/pod/m", ttl_seconds=ttl, requests=list(requests))


GPU = "gpu.nvidia.com"
INVALID = {
    "duplicate names": reserve_request(*[pb.DeviceRequest(name="x", device_class=GPU, count=1)] * 3),
    "negative count": reserve_request(pb.DeviceRequest(name="x", device_class=GPU, count=-1)),
    "unknown class": reserve_request(pb.DeviceRequest(name="x", device_class="tpu.example.com", count=1)),
    "NaN ttl": reserve_request(pb.DeviceRequest(name="x", device_class=GPU, count=1), ttl=float("nan")),
    "bad selector": reserve_request(pb.DeviceRequest(name="x", device_class=GPU, count=1, selectors=["1/0 == 1"])),
}


@pytest.mark.parametrize("request_", list(INVALID.values()), ids=list(INVALID))
def test_a_caller_without_the_token_learns_nothing_about_its_request(
    endpoint: tuple[str, Clock], request_: pb.ReserveRequest
) -> None:
    """Tried: an invalid request without a token got INVALID_ARGUMENT with the validation message."""
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(request_, timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.value.details() == "missing or wrong bearer token"
        with pytest.raises(grpc.RpcError) as err:  # with the token it is the request's fault
            stub.Reserve(request_, metadata=AUTH, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bytes_that_are_no_request_are_unauthenticated_without_the_token(endpoint: tuple[str, Clock]) -> None:
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        raw = channel.unary_unary("/gpudra.arbiter.v1.NodeAllocator/Reserve")
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff not a protobuf", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_duplicate_request_names_are_invalid_argument_and_hold_nothing(endpoint: tuple[str, Clock]) -> None:
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(INVALID["duplicate names"], metadata=AUTH, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request name 'x' is used twice" in (err.value.details() or "")
        assert GrpcNodeClient(channel, TOKEN).capacity().free_gpu_milli == 4000


def test_a_runtime_cel_error_is_invalid_argument(endpoint: tuple[str, Clock], caplog: pytest.LogCaptureFixture) -> None:
    """Tried: `1/0 == 1` raised ZeroDivisionError in the servicer: UNKNOWN and a traceback in the log."""
    address, _ = endpoint
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Reserve(INVALID["bad selector"], metadata=AUTH, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details() == "selector '1/0 == 1' failed: division by zero in CEL expression"
    assert "Traceback" not in caplog.text and not any(r.exc_info for r in caplog.records)


def test_a_lost_reservation_is_failed_precondition_and_reservation_lost_for_the_arbiter(tmp_path: pathlib.Path) -> None:
    holders: dict[str, set[str]] = {}
    b = book(2)
    b._holders = lambda: holders  # type: ignore[method-assign]
    service = NodeAllocatorService(b, TOKEN)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[TokenInterceptor(service)])
    add_to_server(service, server)
    address = f"unix://{tmp_path}/lost.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            client = GrpcNodeClient(channel, TOKEN)
            r = client.reserve("g", "ns/pod/claim", Claim((DeviceRequest("r"),)), 30)
            holders[next(iter(r.fit.all_devices))] = {"ns/another"}
            with pytest.raises(ReservationLost, match="held by ResourceClaim ns/another"):
                client.confirm(r.id)
    finally:
        server.stop(None)
