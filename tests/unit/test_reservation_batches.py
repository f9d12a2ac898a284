"""One Reserve and one Confirm per node of a gang (ReserveMembers, ConfirmMembers): all or none on the node, the
refused member named, TTLs and lost devices as for one member, two gangs racing for the same GPUs; and an arbiter
newer than its node: a node that answers the batch UNIMPLEMENTED is called member by member from then on."""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
import pytest

from agent._proto import arbiter_pb2 as pb
from agent.allocation.allocator import Claim, DeviceRequest, NoFit
from agent.allocation.catalog import NodeUsage
from agent.reservation.protocol import (
    MAX_BATCH,
    GangCoordinator,
    InProcessClient,
    MemberInvalid,
    MemberNoFit,
    MemberPlacement,
    NodeAllocatorService,
    Reservation,
    ReservationBook,
    ReservationLost,
    UnknownReservation,
)
from agent.reservation.transport import (
    GrpcNodeClient,
    NodeAllocatorServicer,
    TokenInterceptor,
    add_to_server,
    claim_to_pb,
)
from tests.unit.test_reservation_book import TOKEN, Clock, book, gpus

SERVICE = "gpudra.arbiter.v1.NodeAllocator"


def free(b: ReservationBook) -> int:
    return sum(b.capacity().free_gpus_by_model.values())


def test_a_batch_that_does_not_fit_whole_holds_nothing_and_names_the_member() -> None:
    """Tried: 2 + 1 + 2 GPUs on a 4-GPU node: the third member is refused, the first two are let go."""
    b = book(4)
    with pytest.raises(MemberNoFit) as refused:
        b.reserve_many("g", [("ns/p0/c", gpus(2)), ("ns/p1/c", gpus(1)), ("ns/p2/c", gpus(2))], 30)
    assert refused.value.member == "ns/p2/c"
    assert b.live() == [] and free(b) == 4
    got = b.reserve_many("g", [("ns/p0/c", gpus(2)), ("ns/p1/c", gpus(2))], 30)
    assert len({d for r in got for d in r.fit.all_devices}) == 4  # the second member beside the first


def test_an_invalid_member_refuses_the_batch_with_the_claims_words() -> None:
    """Tried: two requests of one name in the second member; and an empty batch."""
    b = book(4)
    twice = Claim((DeviceRequest("x"), DeviceRequest("x")))
    with pytest.raises(MemberInvalid, match="used twice") as refused:
        b.reserve_many("g", [("ns/p0/c", gpus(1)), ("ns/p1/c", twice)], 30)
    assert refused.value.member == "ns/p1/c" and b.live() == []
    with pytest.raises(ValueError, match="1 to 64"):
        b.reserve_many("g", [], 30)


def test_a_batch_expires_and_confirms_all_or_none() -> None:
    """Tried: confirming a live reservation together with an expired one: NOT_FOUND, and the live one stays
    unconfirmed (it still expires); then the batch's TTL ends and its GPUs come back."""
    clock = Clock()
    b = book(4, clock)
    short = b.reserve_many("g", [("ns/p0/c", gpus(1))], 5)
    long = b.reserve_many("h", [("ns/p1/c", gpus(1)), ("ns/p2/c", gpus(1))], 50)
    clock.now += 10
    with pytest.raises(UnknownReservation):
        b.confirm_many([long[0].id, short[0].id])
    assert not any(r.confirmed for r in b.live())
    clock.now += 50
    assert b.live() == [] and free(b) == 4


def test_confirming_a_batch_one_of_whose_devices_was_taken_confirms_none() -> None:
    """Tried: a claim allocated one member's GPU meanwhile: FAILED_PRECONDITION for that one, which ends; the
    other member is left unconfirmed for the arbiter to release."""
    taken: dict[str, set[str]] = {}
    clock = Clock()
    b = book(4, clock)
    b._holders = lambda: taken  # the claims the node sees allocated
    first, second = b.reserve_many("g", [("ns/p0/c", gpus(1)), ("ns/p1/c", gpus(1))], 30)
    taken[next(iter(second.fit.all_devices))] = {"ns/other"}
    with pytest.raises(ReservationLost, match="ns/other"):
        b.confirm_many([first.id, second.id])
    assert [(r.id, r.confirmed) for r in b.live()] == [(first.id, False)]
    assert [r.confirmed for r in b.confirm_many([first.id])] == [True]


def test_two_gangs_racing_for_the_same_gpus_never_share_one() -> None:
    """Tried 50 times: two gangs of two 1-GPU members on a 3-GPU node at once: one gets both GPUs it asked for,
    the other nothing."""
    for _ in range(50):
        b = book(3)
        start = threading.Barrier(2)
        outcomes: dict[str, Any] = {}

        def race(
            gang: str, b: ReservationBook = b, start: threading.Barrier = start, outcomes: dict[str, Any] = outcomes
        ) -> None:
            start.wait()
            try:
                outcomes[gang] = b.reserve_many(gang, [(f"ns/{gang}0/c", gpus(1)), (f"ns/{gang}1/c", gpus(1))], 30)
            except NoFit as e:
                outcomes[gang] = e

        threads = [threading.Thread(target=race, args=(g,)) for g in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        won = [g for g, o in outcomes.items() if isinstance(o, list)]
        assert len(won) == 1
        assert sorted(r.gang_id for r in b.live()) == [won[0], won[0]] and free(b) == 1


# --- over gRPC: the new node, and an old one -------------------------------------------------------------------


class Calls(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Records the method of every call the server gets."""

    def __init__(self) -> None:
        self.methods: list[str] = []

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        self.methods.append(handler_call_details.method.rpartition("/")[2])
        return continuation(handler_call_details)


def old_node(service: NodeAllocatorService, server: grpc.Server) -> None:
    """The servicer as an agent before ReserveMembers served it: Reserve, Confirm, Release and Capacity only."""
    servicer = NodeAllocatorServicer(service)
    messages = {
        "Reserve": (pb.ReserveRequest, pb.ReserveResponse),
        "Confirm": (pb.ConfirmRequest, pb.ConfirmResponse),
        "Release": (pb.ReleaseRequest, pb.ReleaseResponse),
        "Capacity": (pb.CapacityRequest, pb.CapacitySummary),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
        )
        for name, (req, resp) in messages.items()
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


Node = tuple[str, ReservationBook, Calls]


def serve(tmp_path: pathlib.Path, name: str, register: Callable[[NodeAllocatorService, grpc.Server], None]) -> Any:
    b = book(4)
    service = NodeAllocatorService(b, TOKEN)
    calls = Calls()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenInterceptor(service), calls])
    register(service, server)
    address = f"unix://{tmp_path}/{name}.sock"
    server.add_insecure_port(address)
    server.start()
    return server, (address, b, calls)


@pytest.fixture(params=["new", "old"])
def node(request: pytest.FixtureRequest, tmp_path: pathlib.Path) -> Iterator[Node]:
    server, out = serve(tmp_path, request.param, add_to_server if request.param == "new" else old_node)
    yield out
    server.stop(None)


def test_a_gang_takes_one_call_a_node_and_falls_back_on_an_old_node(node: Node) -> None:
    """Tried: a gang of three members on one node, twice, against the node as built now and as an agent without
    ReserveMembers was (UNIMPLEMENTED): the new one gets one ReserveMembers and one ConfirmMembers a gang; the
    old one is asked once, then called member by member, and the gang commits on both."""
    address, b, calls = node
    members = [MemberPlacement(f"ns/p{i}/c", "n1", gpus(1)) for i in range(3)]
    with grpc.insecure_channel(address) as channel:
        client = GrpcNodeClient(channel, TOKEN)
        coordinator = GangCoordinator({"n1": client})
        for gang in ("g1", "g2"):
            if gang == "g2":
                b.release(gang_id="g1")
            out = coordinator.place(gang, members, 30)
            assert out.committed and all(r.confirmed for _, r in out.reservations.values())
            assert len({d for _, r in out.reservations.values() for d in r.fit.all_devices}) == 3
    if client.batches:
        assert calls.methods == ["ReserveMembers", "ConfirmMembers"] * 2
    else:  # the one UNIMPLEMENTED is remembered: ConfirmMembers is never tried
        per_member = ["Reserve"] * 3 + ["Confirm"] * 3
        assert calls.methods == ["ReserveMembers", *per_member, *per_member]


def test_a_refused_member_is_named_over_grpc_old_node_or_new(node: Node) -> None:
    """Tried: the second member does not fit, then the second member's claim is invalid: the node names that
    member (trailing metadata, or the fallback's own calls) and holds nothing."""
    address, b, _ = node
    with grpc.insecure_channel(address) as channel:
        client = GrpcNodeClient(channel, TOKEN)
        with pytest.raises(MemberNoFit) as no_fit:
            client.reserve_many("g", [("ns/p0/c", gpus(2)), ("ns/p1/c", gpus(3))], 30)
        assert no_fit.value.member == "ns/p1/c" and b.live() == []
        twice = Claim((DeviceRequest("x"), DeviceRequest("x")))
        with pytest.raises(MemberInvalid, match="used twice") as invalid:
            client.reserve_many("g", [("ns/p0/c", gpus(1)), ("ns/p1/c", twice)], 30)
        assert invalid.value.member == "ns/p1/c" and b.live() == []


def test_a_batch_must_name_one_gang(tmp_path: pathlib.Path) -> None:
    """Tried: ReserveMembers whose second member names another gang: INVALID_ARGUMENT naming it, nothing held."""
    server, (address, b, _) = serve(tmp_path, "n", add_to_server)
    try:
        with grpc.insecure_channel(address) as channel:
            client = GrpcNodeClient(channel, TOKEN)
            request = pb.ReserveMembersRequest(members=[claim_to_pb(g, f"ns/{g}/c", gpus(1), 30) for g in ("a", "b")])
            with pytest.raises(MemberInvalid, match="same gang_id") as refused:
                client._rpc(client._stub.ReserveMembers, request)
            assert refused.value.member == "ns/b/c" and b.live() == []
    finally:
        server.stop(None)


def test_node_usage_counts_a_batch_as_reserved() -> None:
    """Tried: prepare asks who holds a GPU a batch reserved: the batch's member, by its reservation."""
    b = book(2, usage=NodeUsage())
    (r,) = b.reserve_many("g", [("ns/p0/c0", gpus(1))], 30)
    device = next(iter(r.fit.all_devices))
    assert "ns/p0/c0" in b.reserved_for_other(device, "ns/other")
    assert b.reserved_for_other(device, "ns/c0") == ""  # the member's own claim may take it


def test_more_members_on_a_node_than_a_batch_takes_go_in_several_calls() -> None:
    """Tried: 70 tenth-of-a-GPU members on an 8-GPU node (the node takes 64 a call): two Reserves and two
    Confirms of 64 and 6, and the gang commits; with 90 (more than 80 tenths) nothing is held."""
    sizes: list[tuple[str, int]] = []

    class Counting(InProcessClient):
        def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl: float) -> list[Reservation]:
            sizes.append(("reserve", len(members)))
            return super().reserve_many(gang_id, members, ttl)

        def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
            sizes.append(("confirm", len(reservation_ids)))
            return super().confirm_many(reservation_ids)

    b = book(8)
    coordinator = GangCoordinator({"n1": Counting(NodeAllocatorService(b, TOKEN), TOKEN)})
    tenth = Claim((DeviceRequest("s", gpu_milli=100),))
    out = coordinator.place("g", [MemberPlacement(f"ns/p{i}/c", "n1", tenth) for i in range(70)], 30)
    assert out.committed and len(out.reservations) == 70
    assert sizes == [("reserve", MAX_BATCH), ("reserve", 6), ("confirm", MAX_BATCH), ("confirm", 6)]
    b.release(gang_id="g")
    too_many = coordinator.place("h", [MemberPlacement(f"ns/q{i}/c", "n1", tenth) for i in range(90)], 30)
    assert not too_many.committed and "ns/q80/c" in too_many.reason and b.live() == []
