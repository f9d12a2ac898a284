"""Reservations: TTL expiry on an injected clock, confirm, release, auth, gang all-or-nothing across nodes."""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest

from agent.allocation.allocator import Allocator, Claim, DeviceRequest, NoFit
from agent.allocation.catalog import NodeUsage
from agent.allocation.selectors import CelSelectors
from agent.reservation.protocol import (
    GangCoordinator,
    InProcessClient,
    MemberPlacement,
    NodeAllocatorService,
    ReservationBook,
    Unauthenticated,
    UnknownReservation,
)
from tests.unit.test_allocation_allocator import gpu, inventory

TOKEN = "s3cret-token"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def book(gpus: int = 4, clock: Clock | None = None, usage: NodeUsage | None = None) -> ReservationBook:
    inv = inventory(*(gpu(i, "A") for i in range(gpus)))
    ids = (f"r{i}" for i in itertools.count())
    return ReservationBook(
        lambda: inv, lambda: usage or NodeUsage(), Allocator(CelSelectors()), clock or Clock(), lambda: next(ids)
    )


def gpus(n: int) -> Claim:
    return Claim((DeviceRequest("gpus", count=n),))


def test_reserved_devices_are_not_given_twice_and_expire_after_ttl() -> None:
    clock = Clock()
    b = book(4, clock)
    first = b.reserve("g1", "m0", gpus(3), ttl_seconds=30)
    assert first.expires_at == 1030.0
    with pytest.raises(NoFit):  # tried: two more GPUs while three of four are reserved
        b.reserve("g2", "m0", gpus(2), ttl_seconds=30)
    clock.now = 1010.0
    second = b.reserve("g2", "m0", gpus(1), ttl_seconds=30)
    assert not first.fit.all_devices & second.fit.all_devices
    clock.now = 1030.0  # the first TTL ends: its three GPUs come back
    assert b.capacity().free_gpus_by_model == {"NVIDIA H100 80GB HBM3": 3}
    assert [r.id for r in b.live()] == [second.id]
    with pytest.raises(UnknownReservation):  # tried: confirming an expired reservation
        b.confirm(first.id)


def test_confirmed_reservations_outlive_the_ttl_until_released() -> None:
    clock = Clock()
    b = book(2, clock)
    r = b.reserve("g", "m0", gpus(2), ttl_seconds=5)
    b.confirm(r.id)
    clock.now += 3600
    with pytest.raises(NoFit):
        b.reserve("h", "m0", gpus(1), ttl_seconds=5)
    assert b.release(reservation_id=r.id) == 1
    assert b.reserve("h", "m0", gpus(2), ttl_seconds=5)


def test_release_by_gang_frees_all_its_members() -> None:
    b = book(4)
    b.reserve("g", "m0", gpus(1), 10)
    b.reserve("g", "m1", gpus(1), 10)
    other = b.reserve("h", "m0", gpus(1), 10)
    assert b.release(gang_id="g") == 2
    assert [r.id for r in b.live()] == [other.id]
    with pytest.raises(ValueError, match="exactly one"):  # tried: release with no target
        b.release()
    with pytest.raises(ValueError, match="ttl"):  # tried: a zero TTL
        b.reserve("g", "m0", gpus(1), 0)


def test_shared_fractions_add_up_across_reservations() -> None:
    b = book(1)
    half = Claim((DeviceRequest("s", gpu_milli=500),))
    b.reserve("g", "a", half, 10)
    b.reserve("g", "b", half, 10)
    with pytest.raises(NoFit):  # tried: a third half of a one-GPU node
        b.reserve("g", "c", half, 10)


def test_concurrent_reserves_never_hand_out_one_device_twice() -> None:
    b = book(8)
    got: list[frozenset[str]] = []

    def worker(i: int) -> None:
        with contextlib.suppress(NoFit):
            got.append(b.reserve(f"g{i}", "m", gpus(1), 60).fit.all_devices)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    devices = [d for s in got for d in s]
    assert len(devices) == 8 and len(set(devices)) == 8


def test_no_anonymous_or_wrong_token_calls() -> None:
    service = NodeAllocatorService(book(2), TOKEN)
    for bad in (None, "", "wrong", TOKEN + "x"):  # tried: missing, empty, wrong and longer tokens
        with pytest.raises(Unauthenticated):
            InProcessClient(service, bad).reserve("g", "m", gpus(1), 10)
        with pytest.raises(Unauthenticated):
            InProcessClient(service, bad).capacity()
    assert InProcessClient(service, TOKEN).reserve("g", "m", gpus(1), 10).fit.all_devices
    with pytest.raises(ValueError, match="token"):  # tried: configuring no token at all
        NodeAllocatorService(book(1), "")


def cluster(clock: Clock, sizes: dict[str, int]) -> tuple[dict[str, ReservationBook], GangCoordinator]:
    books = {n: book(k, clock) for n, k in sizes.items()}
    clients = {n: InProcessClient(NodeAllocatorService(b, TOKEN), TOKEN) for n, b in books.items()}
    return books, GangCoordinator(clients)


def test_gang_commits_only_when_every_member_is_reserved() -> None:
    clock = Clock()
    books, coord = cluster(clock, {"n1": 4, "n2": 4})
    members = [MemberPlacement("w0", "n1", gpus(4)), MemberPlacement("w1", "n2", gpus(4))]
    out = coord.place("train", members, ttl_seconds=30)
    assert out.committed and set(out.reservations) == {"w0", "w1"}
    assert all(r.confirmed for _, r in out.reservations.values())
    clock.now += 3600  # confirmed: no expiry
    assert all(len(b.live()) == 1 for b in books.values())


def test_gang_with_one_node_refusing_holds_nothing_anywhere() -> None:
    clock = Clock()
    books, coord = cluster(clock, {"n1": 4, "n2": 2, "n3": 4})
    members = [
        MemberPlacement("w0", "n1", gpus(4)),
        MemberPlacement("w1", "n2", gpus(4)),
        MemberPlacement("w2", "n3", gpus(4)),
    ]
    out = coord.place("train", members, ttl_seconds=30)
    assert not out.committed and "w1" in out.reason and "n2" in out.reason
    assert out.reservations == {}
    assert all(b.live() == [] for b in books.values())  # n1's reservation was released, n3 never asked
    unknown = coord.place("x", [MemberPlacement("w0", "n1", gpus(1)), MemberPlacement("w1", "nope", gpus(1))], 30)
    assert not unknown.committed and "nope" in unknown.reason and books["n1"].live() == []


def test_gang_whose_reservation_expired_before_commit_is_released() -> None:
    clock = Clock()

    class SlowClient(InProcessClient):
        def reserve_many(self, *a: object, **kw: object) -> object:  # type: ignore[override]
            r = super().reserve_many(*a, **kw)  # type: ignore[arg-type]
            clock.now += 100  # the arbiter stalls past the TTL after each node's reserve
            return r

    books = {n: book(2, clock) for n in ("n1", "n2")}
    clients = {n: SlowClient(NodeAllocatorService(b, TOKEN), TOKEN) for n, b in books.items()}
    out = GangCoordinator(clients).place(
        "g",
        [
            MemberPlacement("a", "n1", gpus(1)),  # type: ignore[arg-type]
            MemberPlacement("b", "n2", gpus(1)),
        ],
        ttl_seconds=10,
    )
    assert not out.committed and "UnknownReservation" in out.reason
    assert all(b.live() == [] for b in books.values())


def share(milli: int) -> Claim:
    return Claim((DeviceRequest("gpu", gpu_milli=milli),))


def test_shares_are_reserved_beside_each_other_on_a_gpu_with_room_and_end_once_their_claims_hold_them() -> None:
    # gpu-0 holds six 8Gi shares allocated already (101 milli each, as the node counts them); the arbiter
    # reserves three more, then a fourth that only another GPU has room for
    allocated = {"gpu-0": {f"team-a/s{i}" for i in range(6)}}
    sharers: dict[str, set[str]] = {d: set(c) for d, c in allocated.items()}
    usage = NodeUsage(shared_milli={"gpu-0": 6 * 101})
    inv = inventory(*(gpu(i, "A") for i in range(2)))
    ids = (f"r{i}" for i in itertools.count())
    b = ReservationBook(
        lambda: inv,
        lambda: usage,
        Allocator(CelSelectors()),
        Clock(),
        lambda: next(ids),
        hold_confirmed_s=60.0,
        holders=lambda: sharers,
        sharers=lambda: sharers,
    )
    held = [b.reserve("g", f"team-a/p{i}/s{6 + i}", share(101), ttl_seconds=30) for i in range(3)]
    assert [(r.fit.devices, r.fit.shared_milli) for r in held] == [({"gpu": ("gpu-0",)}, {"gpu-0": 101})] * 3
    tenth = b.reserve("g", "team-a/p3/s9", share(101), ttl_seconds=30)
    assert tenth.fit.devices == {"gpu": ("gpu-1",)}  # 9 x 101 on gpu-0: no room for 101 more
    with pytest.raises(NoFit):  # the whole GPUs are not offered whole: both carry shares
        b.reserve("h", "team-b/w/c", gpus(1), ttl_seconds=30)
    # the arbiter writes the claim, then confirms: the other shares on gpu-0 are no holders to lose it to
    sharers["gpu-0"].add("team-a/s6")
    b.confirm(held[0].id)
    assert held[0].id not in {r.id for r in b.live()}  # its claim holds the share now: the reservation ended
    # prepare of a share is not refused for the other shares reserved on its GPU, a whole device's would be
    assert b.reserved_for_other("gpu-0", "team-a/s6", share=True) == ""
    assert b.reserved_for_other("gpu-0", "team-b/whole").startswith("reservation r1")


def test_a_share_reservation_is_lost_to_a_claim_that_holds_its_gpu_whole() -> None:
    holders = {"gpu-0": {"team-b/whole"}}
    inv = inventory(gpu(0, "A"))
    b = ReservationBook(
        lambda: inv, NodeUsage, Allocator(CelSelectors()), Clock(), lambda: "r0", holders=lambda: holders, sharers=dict
    )
    r = b.reserve("g", "team-a/p/s", share(101), ttl_seconds=30)
    with pytest.raises(UnknownReservation, match="held by ResourceClaim team-b/whole"):
        b.confirm(r.id)
