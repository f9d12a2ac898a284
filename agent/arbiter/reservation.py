"""The reservation protocol, agent side and arbiter side, independent of the transport.

Agent: a ReservationBook holds devices for gang members for a TTL over the pure allocator; reserved devices
count as taken for every later fit; expired reservations free themselves; a confirmed one is held until
released. NodeAllocatorService puts bearer-token authentication in front of it (no anonymous call).
Arbiter: GangCoordinator reserves every member of a gang on its node, commits only when all are reserved,
and otherwise releases everything it got: never a partial gang. InProcessClient is the direct-call
transport the simulator uses; reservation_grpc.py carries the same calls over gRPC.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.allocation.allocator import Allocator, Claim, Fit, NoFit
from agent.allocation.capacity import CapacitySummary, summarize
from agent.allocation.catalog import NodeUsage
from agent.devices.model import Inventory

Clock = Callable[[], float]

# A reservation bridges one commit, seconds long; a longer one (or NaN or infinity, which never expire) would
# pin the devices long after the arbiter that asked for them is gone.
MAX_TTL_SECONDS = 600.0


class Unauthenticated(Exception):
    """The call carried no bearer token or the wrong one."""


class NodeUnavailable(ConnectionError):
    """The node's reservation service could not be reached or did not answer in time."""


class UnknownReservation(KeyError):
    """No live reservation has this id (never made, released, or expired)."""


@dataclass(frozen=True)
class Reservation:
    id: str
    gang_id: str
    member: str
    fit: Fit
    expires_at: float
    confirmed: bool = False


class ReservationBook:
    """Thread-safe reservations on one node. `inventory` and `usage` give the node's fresh state.

    `hold_confirmed_s`: how long a confirmed reservation keeps its devices (None: until released). A node
    agent sets it: the arbiter writes the claims before it confirms, so by then the allocation is in the API
    and, once the agent has seen it, counts as allocated on its own; the reservation then ends at once."""

    def __init__(self, inventory: Callable[[], Inventory], usage: Callable[[], NodeUsage],
                 allocator: Allocator, clock: Clock, new_id: Callable[[], str], *,
                 hold_confirmed_s: float | None = None) -> None:
        self._hold_confirmed = hold_confirmed_s
        self._inventory = inventory
        self._usage = usage
        self._allocator = allocator
        self._clock = clock
        self._new_id = new_id
        self._lock = threading.Lock()
        self._live: dict[str, Reservation] = {}

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r.id for r in self._live.values() if r.expires_at <= now]:
            del self._live[rid]

    def settle(self) -> int:
        """Drop confirmed reservations whose devices the node now counts as allocated or prepared: the claim
        holds them from here on (and frees them when it is deallocated). Call it whenever claims change;
        returns how many ended."""
        with self._lock:
            return self._settle()

    def _settle(self) -> int:
        if self._hold_confirmed is None:
            return 0
        base = self._usage()
        held = base.allocated | base.prepared
        done = [r.id for r in self._live.values()
                if r.confirmed and not r.fit.shared_milli and set(r.fit.all_devices) <= held]
        for rid in done:
            del self._live[rid]
        return len(done)

    def _usage_with_reservations(self) -> NodeUsage:
        base = self._usage()
        reserved = set(base.reserved)
        shared = dict(base.shared_milli)
        for r in self._live.values():
            for device, milli in r.fit.shared_milli.items():
                shared[device] = shared.get(device, 0) + milli
            reserved.update(d for d in r.fit.all_devices if d not in r.fit.shared_milli)
        return dataclasses.replace(base, reserved=frozenset(reserved), shared_milli=shared)

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        """Hold devices for one gang member; raises NoFit when the node cannot take it."""
        if not 0 < ttl_seconds <= MAX_TTL_SECONDS:  # also NaN, which compares false both ways
            raise ValueError(f"ttl_seconds must be more than 0 and at most {MAX_TTL_SECONDS:g}, got {ttl_seconds}")
        with self._lock:
            self._expire()
            fit = self._allocator.allocate(self._inventory(), self._usage_with_reservations(), claim)
            r = Reservation(self._new_id(), gang_id, member, fit, self._clock() + ttl_seconds)
            self._live[r.id] = r
            return r

    def confirm(self, reservation_id: str) -> Reservation:
        """Keep the devices past the TTL (the allocation is being committed); fails once expired."""
        with self._lock:
            self._expire()
            r = self._live.get(reservation_id)
            if r is None:
                raise UnknownReservation(reservation_id)
            held_until = self._clock() + self._hold_confirmed if self._hold_confirmed is not None else math.inf
            r = self._live[reservation_id] = dataclasses.replace(r, confirmed=True, expires_at=held_until)
            self._settle()  # the claim may be seen already
            return r

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        """Free one reservation, or every one of a gang; returns how many were freed."""
        if bool(reservation_id) == bool(gang_id):
            raise ValueError("release needs exactly one of reservation_id or gang_id")
        with self._lock:
            gone = [r.id for r in self._live.values() if reservation_id in ("", r.id) and gang_id in ("", r.gang_id)]
            for rid in gone:
                del self._live[rid]
            return len(gone)

    def live(self) -> list[Reservation]:
        with self._lock:
            self._expire()
            return list(self._live.values())

    def capacity(self) -> CapacitySummary:
        with self._lock:
            self._expire()
            return summarize(self._inventory(), self._usage_with_reservations())


def token_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison; an empty configured token never matches (no anonymous access)."""
    if not expected or presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


class NodeAllocatorService:
    """The authenticated node-side API; every transport calls this with the bearer token it received."""

    def __init__(self, book: ReservationBook, token: str) -> None:
        if not token:
            raise ValueError("the node allocator needs a token: anonymous reservations are not allowed")
        self.book = book
        self._token = token

    def _check(self, bearer: str | None) -> None:
        if not token_matches(bearer, self._token):
            raise Unauthenticated("missing or wrong bearer token")

    def reserve(self, bearer: str | None, gang_id: str, member: str, claim: Claim,
                ttl_seconds: float) -> Reservation:
        self._check(bearer)
        return self.book.reserve(gang_id, member, claim, ttl_seconds)

    def confirm(self, bearer: str | None, reservation_id: str) -> Reservation:
        self._check(bearer)
        return self.book.confirm(reservation_id)

    def release(self, bearer: str | None, reservation_id: str = "", gang_id: str = "") -> int:
        self._check(bearer)
        return self.book.release(reservation_id, gang_id)

    def capacity(self, bearer: str | None) -> CapacitySummary:
        self._check(bearer)
        return self.book.capacity()


class NodeClient(Protocol):
    """What the arbiter calls on one node, whatever the transport. Reserve raises NoFit when it cannot."""

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation: ...
    def confirm(self, reservation_id: str) -> Reservation: ...
    def release(self, reservation_id: str = "", gang_id: str = "") -> int: ...
    def capacity(self) -> CapacitySummary: ...


class InProcessClient:
    """Direct calls into a node's service, carrying a token like the real transport does."""

    def __init__(self, service: NodeAllocatorService, token: str | None) -> None:
        self._service = service
        self._token = token

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        return self._service.reserve(self._token, gang_id, member, claim, ttl_seconds)

    def confirm(self, reservation_id: str) -> Reservation:
        return self._service.confirm(self._token, reservation_id)

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        return self._service.release(self._token, reservation_id, gang_id)

    def capacity(self) -> CapacitySummary:
        return self._service.capacity(self._token)


@dataclass(frozen=True)
class MemberPlacement:
    member: str
    node: str
    claim: Claim


@dataclass(frozen=True)
class GangOutcome:
    committed: bool
    reservations: Mapping[str, tuple[str, Reservation]]  # member -> (node, reservation); empty unless committed
    reason: str = ""


Held = dict[str, tuple[str, Reservation]]  # member -> (node, reservation)


class GangCoordinator:
    """Two-phase gang placement across nodes: reserve all, then confirm all, or release all.

    `place` does both phases at once (the simulator); the controller calls `reserve_all`, writes the claims,
    then `confirm_all`, releasing everything with `release_all` when any step fails."""

    def __init__(self, nodes: Mapping[str, NodeClient]) -> None:
        self.nodes = nodes

    def place(self, gang_id: str, members: Sequence[MemberPlacement], ttl_seconds: float) -> GangOutcome:
        held, reason = self.reserve_all(gang_id, members, ttl_seconds)
        if reason:
            return GangOutcome(False, {}, reason)
        reason = self.confirm_all(held)
        if reason:
            return GangOutcome(False, {}, reason)
        return GangOutcome(True, held)

    def reserve_all(self, gang_id: str, members: Sequence[MemberPlacement], ttl_seconds: float) -> tuple[Held, str]:
        """Reserve every member on its node; on the first refusal release what was got and say why."""
        held: Held = {}
        reason = ""
        try:
            for m in members:
                client = self.nodes.get(m.node)
                if client is None:
                    reason = f"member {m.member}: unknown node {m.node}"
                    break
                try:
                    held[m.member] = (m.node, client.reserve(gang_id, m.member, m.claim, ttl_seconds))
                except NoFit as e:
                    reason = f"member {m.member} does not fit on {m.node}: {e}"
                    break
        except (UnknownReservation, Unauthenticated, OSError) as e:
            reason = f"{type(e).__name__}: {e}"
        except BaseException:
            self.release_all(held)
            raise
        if reason:
            self.release_all(held)
            return {}, reason
        return held, ""

    def confirm_all(self, held: Held) -> str:
        """Confirm every reservation ("" on success); on failure release all and say why."""
        try:
            for member, (node, r) in list(held.items()):
                self.nodes[node].confirm(r.id)
                # what reserve returned, confirmed: a transport's confirm need not echo the devices (gRPC's doesn't)
                held[member] = (node, dataclasses.replace(r, confirmed=True))
        except (UnknownReservation, Unauthenticated, OSError) as e:
            self.release_all(held)
            return f"{type(e).__name__}: {e}"
        except BaseException:
            self.release_all(held)
            raise
        return ""

    def release_all(self, held: Mapping[str, tuple[str, Reservation]]) -> None:
        for node, r in held.values():
            try:
                self.nodes[node].release(reservation_id=r.id)
            except (UnknownReservation, Unauthenticated, OSError):
                continue  # already gone, unreachable or refusing us: its TTL frees it
