"""Issue 33: what the reservation API must refuse (item 12), Reserves with selectors bounded so that Capacity
and Release never queue behind them (item 10), and refusals that name their node (item 9). Over a real gRPC
server on a unix socket, with the node agent's thread count."""

from __future__ import annotations

import pathlib
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc
import pytest

from agent._proto import arbiter_pb2 as pb
from agent._proto import arbiter_pb2_grpc as pb_grpc
from agent.allocation.allocator import Claim, DeviceRequest, NoFit
from agent.allocation.capacity import CapacitySummary
from agent.allocation.selectors import EvaluatedSelectors, device_key
from agent.reservation.node_service import SERVER_THREADS
from agent.reservation.protocol import (
    GangCoordinator,
    MemberPlacement,
    NodeAllocatorService,
    NodeBusy,
    NodeUnavailable,
    Reservation,
    Unauthenticated,
    reserve_each,
)
from agent.reservation.selector_worker import MAX_ADMITTED, MAX_WORKERS, WorkerSelectors
from agent.reservation.transport import GrpcNodeClient, TokenInterceptor, add_to_server
from tests.unit.test_reservation_book import TOKEN, book

AUTH = (("authorization", f"Bearer {TOKEN}"),)
GPU = "gpu.nvidia.com"
MEMBER = "default/trainer-0/gpus"


class LatchedSelectors(WorkerSelectors):
    """The node's selector workers with the evaluation itself held on a latch (no process): every admitted
    Reserve stays inside its selectors until the test opens the latch."""

    def __init__(self) -> None:
        super().__init__()
        self.latch = threading.Event()
        self.inside = threading.Semaphore(0)

    def _evaluate(
        self, expressions: Sequence[str], devices: Sequence[Mapping[str, Any]], deadline: float
    ) -> EvaluatedSelectors:
        self.inside.release()
        assert self.latch.wait(30)
        return EvaluatedSelectors({(e, device_key(d)): True for e in expressions for d in devices})


@pytest.fixture
def served(tmp_path: pathlib.Path) -> Iterator[tuple[str, LatchedSelectors, NodeAllocatorService]]:
    selectors = LatchedSelectors()
    b = book(8)
    b._evaluator = selectors
    service = NodeAllocatorService(b, TOKEN)
    server = grpc.server(futures.ThreadPoolExecutor(SERVER_THREADS), interceptors=[TokenInterceptor(service)])
    add_to_server(service, server)
    address = f"unix://{tmp_path}/node.sock"
    server.add_insecure_port(address)
    server.start()
    yield address, selectors, service
    selectors.latch.set()
    server.stop(None)


def request(count: int = 1, member: str = MEMBER, selectors: Sequence[str] = ()) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        gang_id="g",
        member=member,
        ttl_seconds=30,
        requests=[pb.DeviceRequest(name="gpus", device_class=GPU, count=count, selectors=list(selectors))],
    )


def refused(
    stub: pb_grpc.NodeAllocatorStub, req: pb.ReserveRequest, metadata: tuple[tuple[str, str], ...] = AUTH
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.Reserve(req, metadata=metadata, timeout=5)
    return err.value


# --- item 12 ------------------------------------------------------------------------------------------------


def test_a_count_of_zero_is_refused_not_read_as_one(served: tuple[str, LatchedSelectors, Any]) -> None:
    address, _, service = served
    with grpc.insecure_channel(address) as channel:
        err = refused(pb_grpc.NodeAllocatorStub(channel), request(count=0))  # tried: it reserved one GPU
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "request 'gpus': count must be at least 1, got 0"
    assert service.book.live() == []


@pytest.mark.parametrize("member", ["", "trainer-0", "default//gpus", "default/trainer-0/gpus/extra"])
def test_a_member_that_names_no_claim_is_refused(served: tuple[str, LatchedSelectors, Any], member: str) -> None:
    """Tried: an empty member made a reservation tied to no claim, which every prepare of its devices meets."""
    address, _, service = served
    with grpc.insecure_channel(address) as channel:
        err = refused(pb_grpc.NodeAllocatorStub(channel), request(member=member))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"member must be <namespace>/<pod>/<claim>, the ResourceClaim the devices are for, not {member!r}" in (
        err.details() or ""
    )
    assert service.book.live() == []


def test_an_empty_member_or_gang_is_refused_by_the_book_too() -> None:
    b = book(2)
    with pytest.raises(ValueError, match="member is empty"):
        b.reserve("g", "", Claim((DeviceRequest("gpus"),)), 30)
    with pytest.raises(ValueError, match="gang_id is empty"):
        b.reserve("", MEMBER, Claim((DeviceRequest("gpus"),)), 30)
    assert b.live() == []


@pytest.mark.parametrize("second", [f"Bearer {TOKEN}", "Bearer wrong"])
def test_two_authorization_headers_are_unauthenticated(served: tuple[str, LatchedSelectors, Any], second: str) -> None:
    """Tried: with two `authorization` entries the first one won, whatever the second said."""
    address, _, service = served
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.NodeAllocatorStub(channel)
        err = refused(stub, request(), metadata=(*AUTH, ("authorization", second)))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert err.details() == "2 authorization headers: send exactly one"
        with pytest.raises(grpc.RpcError) as capacity:
            stub.Capacity(pb.CapacityRequest(), metadata=(*AUTH, ("authorization", second)), timeout=5)
        assert capacity.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert service.book.live() == []


# --- item 10 ------------------------------------------------------------------------------------------------


def test_reserves_past_the_bound_are_refused_at_once_and_capacity_and_release_are_answered_meanwhile(
    served: tuple[str, LatchedSelectors, NodeAllocatorService],
) -> None:
    """Tried: 16 concurrent Reserves with costly selectors filled the node's 8 threads; Capacity took 4.69 s
    and 8 Reserves hit DEADLINE_EXCEEDED. Here the admitted ones stay inside their selectors (a latch) for as
    long as the test likes: every other Reserve is refused busy at once, and Capacity and Release answer."""
    address, selectors, service = served
    concurrent = 2 * SERVER_THREADS
    with grpc.insecure_channel(address) as channel:
        client = GrpcNodeClient(channel, TOKEN, timeout_s=30)
        costly = Claim((DeviceRequest("gpus", selectors=("device.attributes['gpu.nvidia.com'].index >= 0",)),))
        outcomes: list[object] = []

        def reserve(i: int) -> None:
            try:
                outcomes.append(client.reserve(f"g{i}", f"default/p{i}/gpus", costly, 30))
            except NodeBusy as e:
                outcomes.append(e)

        threads = [threading.Thread(target=reserve, args=(i,)) for i in range(concurrent)]
        for t in threads:
            t.start()
        for _ in range(MAX_WORKERS):  # that many are inside their selectors, the rest admitted wait for a worker
            assert selectors.inside.acquire(timeout=10)
        deadline = time.monotonic() + 10
        while len(outcomes) < concurrent - MAX_ADMITTED:
            assert time.monotonic() < deadline, f"only {len(outcomes)} Reserves answered while the rest wait"
            time.sleep(0.01)
        assert all(isinstance(o, NodeBusy) for o in outcomes)
        assert selectors.refused == concurrent - MAX_ADMITTED
        # the admitted Reserves still hold their threads: Capacity and Release are answered all the same
        for _ in range(20):
            assert client.capacity().free_gpus_by_model == {"NVIDIA H100 80GB HBM3": 8}
            assert client.release(gang_id="nothing") == 0
        selectors.latch.set()
        for t in threads:
            t.join(10)
    admitted = [o for o in outcomes if isinstance(o, Reservation)]
    assert len(admitted) == MAX_ADMITTED and len(service.book.live()) == MAX_ADMITTED
    assert MAX_ADMITTED <= SERVER_THREADS - 2  # threads no selector may take


def test_a_busy_node_is_told_apart_from_a_claim_that_does_not_fit(
    served: tuple[str, LatchedSelectors, NodeAllocatorService],
) -> None:
    """RESOURCE_EXHAUSTED is both "does not fit" and "busy": the arbiter must not read busy as the claim's."""
    address, selectors, _ = served
    with grpc.insecure_channel(address) as channel:
        client = GrpcNodeClient(channel, TOKEN)
        with pytest.raises(NoFit):
            client.reserve("g", MEMBER, Claim((DeviceRequest("gpus", count=9),)), 30)
        for _ in range(MAX_ADMITTED):
            selectors._admitted.acquire()  # as if that many Reserves were evaluating
        with pytest.raises(NodeBusy, match="node busy, try again later") as busy:
            client.reserve("g", MEMBER, Claim((DeviceRequest("gpus", selectors=("true",)),)), 30)
        assert isinstance(busy.value, NodeUnavailable) and not isinstance(busy.value, NoFit)


# --- item 9: the node named ---------------------------------------------------------------------------------


class Refusing:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        raise self.error

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        return reserve_each(self.reserve, self.release, gang_id, members, ttl_seconds)

    def confirm(self, reservation_id: str) -> Reservation:
        raise self.error

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        raise self.error

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        return 0

    def capacity(self) -> CapacitySummary:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        Unauthenticated("the API server does not accept the token"),
        NodeUnavailable("UNAVAILABLE: connection refused"),
        NodeBusy("node busy"),
    ],
)
def test_a_refused_reserve_names_its_node(error: Exception) -> None:
    """Tried: the Event said "Unauthenticated: missing or wrong bearer token" and not which node refused."""
    coordinator = GangCoordinator({"gpu-node-7": Refusing(error)})
    _, refused = coordinator.reserve_all("g", [MemberPlacement(MEMBER, "gpu-node-7", Claim((DeviceRequest("r"),)))], 30)
    assert refused is not None and refused.reason.startswith(f"node gpu-node-7: {type(error).__name__}: ")
