"""Issue 17, items 5-7 in the book: one holder per device (Confirm re-checks, prepare refuses a reserved
device), unique request names with replies that always name what is held, and CEL errors as bad requests."""

from __future__ import annotations

import itertools
import pathlib
from collections.abc import Collection, Mapping

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.allocation.allocator import Allocator, Claim, DeviceRequest, NoFit
from agent.allocation.catalog import NodeUsage
from agent.allocation.cel import SelectorError
from agent.allocation.selectors import CelSelectors
from agent.claims import cdi
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef
from agent.reservation.protocol import ReservationBook, ReservationLost, UnknownReservation, claim_of
from tests.claim_sources import StaticClaimSource
from tests.unit.test_allocation_allocator import gpu, inventory
from tests.unit.test_claims_support import DRIVER, NODE, claim
from tests.unit.test_claims_support import inventory as claims_inventory
from tests.unit.test_reservation_book import Clock

MEMBER = "team-a/trainer-0/trainer-0-gpus"  # the arbiter's member name: namespace/pod/claim
CLAIM = "team-a/trainer-0-gpus"


def book(gpus: int = 4, clock: Clock | None = None, holders: dict[str, set[str]] | None = None) -> ReservationBook:
    inv = inventory(*(gpu(i, "A") for i in range(gpus)))
    ids = (f"r{i}" for i in itertools.count())
    held: Mapping[str, Collection[str]] = holders if holders is not None else {}
    return ReservationBook(
        lambda: inv, NodeUsage, Allocator(CelSelectors()), clock or Clock(), lambda: next(ids), holders=lambda: held
    )


def gpus(n: int) -> Claim:
    return Claim((DeviceRequest("gpus", count=n),))


def test_the_claim_a_reservation_is_for_comes_from_the_arbiters_member_name() -> None:
    assert claim_of(MEMBER) == CLAIM
    assert claim_of("m0") is None and claim_of("a//c") is None and claim_of("a/b/c/d") is None


# --- item 5: Confirm re-checks; prepare refuses a device reserved for another claim ----------------------


def test_confirm_fails_once_another_claim_holds_a_reserved_device() -> None:
    """Tried: the device was meanwhile allocated to another claim and prepared; Confirm still said OK."""
    holders: dict[str, set[str]] = {}
    b = book(4, holders=holders)
    r = b.reserve("g", MEMBER, gpus(2), 30)
    taken = sorted(r.fit.all_devices)[0]
    holders[taken] = {"team-b/intruder"}
    with pytest.raises(ReservationLost, match=f"no longer holds {taken} \\(held by ResourceClaim team-b/intruder\\)"):
        b.confirm(r.id)
    assert b.live() == []  # the reservation is gone: its other device is free again
    with pytest.raises(UnknownReservation):  # ReservationLost is an UnknownReservation for the arbiter
        b.confirm(r.id)


def test_confirm_succeeds_when_only_its_own_claim_holds_the_devices() -> None:
    holders: dict[str, set[str]] = {}
    b = book(4, holders=holders)
    r = b.reserve("g", MEMBER, gpus(2), 30)
    for d in r.fit.all_devices:  # the arbiter wrote the allocation before confirming: the claim is this one
        holders[d] = {CLAIM}
    assert b.confirm(r.id).confirmed


def test_prepare_of_another_claim_is_refused_while_a_reservation_holds_the_device(tmp_path: pathlib.Path) -> None:
    clock = Clock()
    b = book(8, clock)
    r = b.reserve(
        "g", MEMBER, Claim((DeviceRequest("gpus", selectors=('device.attributes["gpu.nvidia.com"].index == 0',)),)), 30
    )
    assert r.fit.all_devices == {"gpu-0"}
    source = StaticClaimSource()
    preparer = ClaimPreparer(
        PrepareSettings(
            node_name=NODE,
            driver_name=DRIVER,
            inventory=claims_inventory,
            mig_caps=cdi.MigCaps(lambda: None),
            reserved=b.reserved_for_other,
        ),
        state_dir=tmp_path / "state",
        cdi_root=tmp_path / "cdi",
        source=source,
        lock_timeout=0.2,
    )
    source.put(claim("uid-x", ["gpu-0"], name="intruder", namespace="team-b"))
    result = preparer.prepare([ClaimRef("team-b", "uid-x", "intruder")])["uid-x"]
    assert result.error == (f"device gpu-0 is reserved for another claim: reservation r0 (gang g, member {MEMBER})")
    # its own claim may be prepared (the arbiter committed it before the reservation ended)
    source.put(claim("uid-own", ["gpu-0"], name="trainer-0-gpus", namespace="team-a"))
    assert not preparer.prepare([ClaimRef("team-a", "uid-own", "trainer-0-gpus")])["uid-own"].error
    clock.now += 31  # an expired reservation holds nothing
    assert b.reserved_for_other("gpu-0", "team-b/intruder") == ""


# --- item 6: unique request names; the reply names exactly what is held ----------------------------------


def test_duplicate_request_names_are_refused_and_hold_nothing() -> None:
    """Tried: three requests named `x` held GPUs and the reply named one."""
    b = book(4)
    with pytest.raises(ValueError, match="request name 'x' is used twice"):
        b.reserve("g", "m", Claim(tuple(DeviceRequest("x") for _ in range(3))), 30)
    assert b.live() == [] and b.capacity().free_gpu_milli == 4000


requests = st.builds(
    lambda name, count, milli: DeviceRequest(name, count=1 if milli else count, gpu_milli=milli),
    st.sampled_from(["a", "b", "c"]),
    st.integers(1, 3),
    st.none() | st.sampled_from([250, 500, 750]),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.lists(requests, min_size=1, max_size=4), min_size=1, max_size=5))
def test_replies_and_holdings_always_agree(claims: list[list[DeviceRequest]]) -> None:
    b = book(4)
    for i, reqs in enumerate(claims):
        before = b.live()
        try:
            r = b.reserve(f"g{i}", "m", Claim(tuple(reqs)), 30)
        except (ValueError, NoFit):
            assert b.live() == before  # a refusal holds nothing
            continue
        # every request is named, with as many devices as it asked for
        assert {q.name: q.count for q in reqs} == {name: len(ds) for name, ds in r.fit.devices.items()}
        assert len(r.fit.all_devices) == sum(q.count for q in reqs)
    # the node's holdings are exactly what the replies named
    live = b.live()
    whole = {d for r in live for d in r.fit.all_devices if d not in r.fit.shared_milli}
    shared: dict[str, int] = {}
    for r in live:
        for d, m in r.fit.shared_milli.items():
            shared[d] = shared.get(d, 0) + m
    assert not whole & set(shared)
    assert all(m <= 1000 for m in shared.values())
    assert b.capacity().free_gpu_milli == 4000 - 1000 * len(whole) - sum(shared.values())


# --- item 7: a runtime CEL error is the request's fault ------------------------------------------------


def test_a_runtime_cel_error_is_a_selector_error_not_a_crash() -> None:
    """Tried: `1/0 == 1` raised ZeroDivisionError out of the allocator (a traceback and UNKNOWN over gRPC)."""
    b = book(2)
    with pytest.raises(SelectorError, match="division by zero"):
        b.reserve("g", "m", Claim((DeviceRequest("x", selectors=("1/0 == 1",)),)), 30)
    assert b.live() == []


def test_a_selector_longer_than_kube_apiservers_limit_is_refused() -> None:
    b = book(2)
    long = "true && " * 1300 + "true"  # over 10 KiB, CELSelectorExpressionMaxLength
    with pytest.raises(SelectorError, match="at most 10240"):
        b.reserve("g", "m", Claim((DeviceRequest("x", selectors=(long,)),)), 30)
