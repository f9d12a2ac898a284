"""The reservation protocol, agent side and arbiter side, independent of the transport.

Agent: a ReservationBook holds devices for gang members for a TTL over the pure allocator; reserved devices
count as taken for every later fit; expired reservations free themselves; a confirmed one is held until
released. It is also the one place that says who else holds a device (`_others`): Confirm re-checks that a
reservation still holds all its devices, and prepare asks it before taking a device (`reserved_for_other`).
NodeAllocatorService puts authentication in front of it (no anonymous call): an Authenticator checks the
bearer token (the node agent's asks the API server, agent.reservation.auth; the simulator shares one).
Arbiter: GangCoordinator reserves every member of a gang on its node, commits only when all are reserved,
and otherwise releases everything it got: never a partial gang. InProcessClient is the direct-call
transport the simulator uses; reservation_grpc.py carries the same calls over gRPC.
"""

from __future__ import annotations

import dataclasses
import hmac
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from agent.allocation.allocator import Allocator, Claim, Fit, NoFit
from agent.allocation.capacity import CapacitySummary, summarize
from agent.allocation.catalog import NodeUsage, candidates
from agent.allocation.selectors import SelectorEngine
from agent.devices.model import Inventory
from agent.devices.names import InvalidDeviceName

Clock = Callable[[], float]
T = TypeVar("T")
# device -> the claims ("namespace/name") that hold it on this node: allocated in the API or prepared here
Holders = Callable[[], Mapping[str, Collection[str]]]

# A reservation bridges one commit, seconds long; a longer one (or NaN or infinity, which never expire) would
# pin the devices long after the arbiter that asked for them is gone.
MAX_TTL_SECONDS = 600.0
# Members one ReserveMembers may reserve: a batch holds the book's lock for all of them (a node has 8 GPUs,
# and at most 7 MIG devices each)
MAX_BATCH = 64


class Unauthenticated(Exception):
    """The call carried no bearer token or the wrong one."""


class NodeUnavailable(ConnectionError):
    """The node's reservation service could not be reached or did not answer in time."""


class NodeBusy(NodeUnavailable):
    """The node refused a Reserve at once because as many as it takes are already evaluating selectors: the
    node is busy, the claim is not wrong; try again later (RESOURCE_EXHAUSTED marked busy on the wire)."""


class UnknownReservation(KeyError):
    """No live reservation has this id (never made, released, or expired)."""


class ReservationLost(UnknownReservation):
    """The reservation no longer holds all its devices (another claim took one): it is gone."""


class MemberInvalid(ValueError):
    """A batch refused for what one member's claim asks (INVALID_ARGUMENT); `member` names it, the message is
    the node's words about that claim."""

    def __init__(self, member: str, message: str) -> None:
        super().__init__(message)
        self.member = member


class MemberNoFit(NoFit):
    """A batch refused because one member does not fit beside the others; `member` names it."""

    def __init__(self, member: str, message: str) -> None:
        super().__init__(message)
        self.member = member


class SelectorEvaluator(Protocol):
    """Evaluates a claim's CEL selectors on the node's devices before the fit, outside the book's lock and
    within a budget; the answer is a SelectorEngine the allocator reads without running CEL again.
    Raises SelectorError (INVALID_ARGUMENT) or TimeoutError (the caller's deadline passed)."""

    def evaluate(
        self, expressions: Sequence[str], devices: Sequence[Mapping[str, Any]], timeout_s: float | None
    ) -> SelectorEngine: ...


def claim_of(member: str) -> str | None:
    """The claim ("namespace/name") a reservation is for: the arbiter names its members
    `<namespace>/<pod>/<claim>` (proto/arbiter.proto); None for any other name."""
    parts = member.split("/")
    return f"{parts[0]}/{parts[2]}" if len(parts) == 3 and all(parts) else None


def check_claim(claim: Claim) -> None:
    """What the allocator cannot catch: a reply names devices per request, so two requests of one name
    would hold devices the reply cannot name (tried: three requests `x` held GPUs and named one)."""
    seen: set[str] = set()
    for r in claim.requests:
        if not r.name:
            raise ValueError("every request needs a name")
        if r.name in seen:
            raise ValueError(f"request name {r.name!r} is used twice: request names must be unique")
        seen.add(r.name)


@dataclass(frozen=True)
class Reservation:
    id: str
    gang_id: str
    member: str
    fit: Fit
    expires_at: float
    confirmed: bool = False

    @property
    def claim(self) -> str | None:
        return claim_of(self.member)


class ReservationBook:
    """Thread-safe reservations on one node. `inventory` and `usage` give the node's fresh state.

    `hold_confirmed_s`: how long a confirmed reservation keeps its devices (None: until released). A node
    agent sets it: the arbiter writes the claims before it confirms, so by then the allocation is in the API
    and, once the agent has seen it, counts as allocated on its own; the reservation then ends at once."""

    def __init__(
        self,
        inventory: Callable[[], Inventory],
        usage: Callable[[], NodeUsage],
        allocator: Allocator,
        clock: Clock,
        new_id: Callable[[], str],
        *,
        hold_confirmed_s: float | None = None,
        holders: Holders | None = None,
        sharers: Holders | None = None,
        evaluator: SelectorEvaluator | None = None,
    ) -> None:
        """`holders`: the claims holding each device, for Confirm's re-check (None: no claims to check);
        `sharers`: those of them that hold only a consumable-capacity share of it (a share reservation may
        sit beside them: the usage counts their fractions).
        `evaluator`: runs selectors before the fit, outside the lock (None: the allocator runs them itself)."""
        self._hold_confirmed = hold_confirmed_s
        self._holders = holders or (lambda: {})
        self._sharers = sharers or (lambda: {})
        self._evaluator = evaluator
        self._inventory = inventory
        self._usage = usage
        self._allocator = allocator
        self._clock = clock
        self._new_id = new_id
        self._lock = threading.Lock()
        self._live: dict[str, Reservation] = {}
        # device -> live reservations holding it; replaced whole under the lock, read without it (prepare asks
        # while it holds the node lock, which reserve takes inside this lock to read the prepared devices)
        self._by_device: Mapping[str, tuple[Reservation, ...]] = {}

    def _changed(self) -> None:
        by_device: dict[str, tuple[Reservation, ...]] = {}
        for r in self._live.values():
            for d in r.fit.all_devices:
                by_device[d] = (*by_device.get(d, ()), r)
        self._by_device = by_device

    def _expire(self) -> None:
        now = self._clock()
        gone = [r.id for r in self._live.values() if r.expires_at <= now]
        for rid in gone:
            del self._live[rid]
        if gone:
            self._changed()

    def _others(
        self,
        device: str,
        claim: str | None,
        reservation: Reservation | None,
        reservations: Mapping[str, tuple[Reservation, ...]],
        holders: Mapping[str, Collection[str]],
        *,
        sharers: Mapping[str, Collection[str]],
    ) -> list[str]:
        """Who holds `device` besides the claim `claim` and `reservation`: live reservations for other claims
        and claims allocated or prepared here (other shares of a GPU `reservation` shares are not: the allocator
        made them fit). The one check of one holder per device."""
        now = self._clock()
        shares = reservation is not None and device in reservation.fit.shared_milli
        others = [
            f"reservation {r.id} (gang {r.gang_id}, member {r.member})"
            for r in reservations.get(device, ())
            if (reservation is None or r.id != reservation.id)
            and r.expires_at > now
            and (claim is None or r.claim != claim)
            and not (shares and device in r.fit.shared_milli)
        ]
        others += [
            f"ResourceClaim {c}"
            for c in sorted(holders.get(device, ()))
            if c != claim and not (shares and c in sharers.get(device, ()))
        ]
        return others

    def reserved_for_other(self, device: str, claim: str, share: bool = False) -> str:
        """Why `claim` may not take `device` now ("" when it may): a live reservation for another claim holds
        it (whole, when `claim` takes a consumable-capacity share of it: shares sit beside shares).
        Lock-free (see _by_device): prepare calls it under the node lock."""
        reservations = self._by_device
        if share:
            reservations = {device: tuple(r for r in reservations.get(device, ()) if device not in r.fit.shared_milli)}
        return ", ".join(self._others(device, claim, None, reservations, {}, sharers={}))

    def settle(self) -> int:
        """Drop confirmed reservations whose devices the node now counts as allocated or prepared: the claim
        holds them from here on (and frees them when it is deallocated). Call it whenever claims change;
        returns how many ended."""
        with self._lock:
            return self._settle()

    def _settle(self) -> int:
        # no confirmed reservation, nothing to end: the usage is not read (a claim event's common case)
        if self._hold_confirmed is None or not any(r.confirmed for r in self._live.values()):
            return 0
        base = self._usage()
        held = base.allocated | base.prepared
        done = [
            r.id
            for r in self._live.values()
            if r.confirmed and not r.fit.shared_milli and set(r.fit.all_devices) <= held
        ]
        # a share's device stays shared by others: it ends once its own claim holds its share (allocated here)
        if any(r.confirmed and r.fit.shared_milli for r in self._live.values()):
            sharers = self._sharers()
            done += [
                r.id
                for r in self._live.values()
                if r.confirmed
                and r.fit.shared_milli
                and r.claim
                and all(r.claim in sharers.get(d, ()) for d in r.fit.shared_milli)
            ]
        for rid in done:
            del self._live[rid]
        if done:
            self._changed()
        return len(done)

    def _usage_with_reservations(self) -> NodeUsage:
        base = self._usage()
        reserved = set(base.reserved)
        shared = dict(base.shared_milli)
        # a share whose claim the node already counts as allocated is not counted twice (until it settles)
        sharers = self._sharers() if any(r.fit.shared_milli for r in self._live.values()) else {}
        for r in self._live.values():
            for device, milli in r.fit.shared_milli.items():
                if r.claim is None or r.claim not in sharers.get(device, ()):
                    shared[device] = shared.get(device, 0) + milli
            reserved.update(d for d in r.fit.all_devices if d not in r.fit.shared_milli)
        return dataclasses.replace(base, reserved=frozenset(reserved), shared_milli=shared)

    def _checked(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> None:
        if not gang_id:
            raise ValueError("gang_id is empty: a reservation belongs to a gang, which releases it")
        if not member:
            raise ValueError("member is empty: a reservation holds devices for one claim, which it must name")
        if not 0 < ttl_seconds <= MAX_TTL_SECONDS:  # also NaN, which compares false both ways
            raise ValueError(f"ttl_seconds must be more than 0 and at most {MAX_TTL_SECONDS:g}, got {ttl_seconds}")
        check_claim(claim)

    def _allocator_for(self, claim: Claim, timeout_s: float | None) -> Allocator:
        """The allocator for `claim`, its selectors evaluated first (outside the lock) where an evaluator is set."""
        expressions = sorted({s for r in claim.requests for s in r.selectors})
        if not expressions or self._evaluator is None:
            return self._allocator
        # every device the node could offer (nothing taken is a superset of any moment's offer), outside the
        # lock: a costly selector then delays only its own call, never Capacity or another Reserve
        devices = [c.env for c in candidates(self._inventory(), NodeUsage())]
        table = self._evaluator.evaluate(expressions, devices, timeout_s)
        return Allocator(table, self._allocator.policy, self._allocator.mix)

    def reserve(
        self, gang_id: str, member: str, claim: Claim, ttl_seconds: float, timeout_s: float | None = None
    ) -> Reservation:
        """Hold devices for one gang member; raises NoFit when the node cannot take it, ValueError for a bad
        request (a selector included) and TimeoutError when its selectors outlast `timeout_s`."""
        try:
            return self.reserve_many(gang_id, [(member, claim)], ttl_seconds, timeout_s)[0]
        except (MemberInvalid, MemberNoFit) as e:  # one member: the refusal as it was, not naming the member
            raise e.__cause__ or e from None

    def reserve_many(
        self,
        gang_id: str,
        members: Sequence[tuple[str, Claim]],
        ttl_seconds: float,
        timeout_s: float | None = None,
    ) -> list[Reservation]:
        """Hold devices for several (member, claim) of one gang, all or none, in order: each as `reserve` would,
        the later ones beside the earlier ones. A refusal ends what this call reserved and names its member
        (MemberInvalid, MemberNoFit); NodeBusy and TimeoutError as `reserve` raises them."""
        if not members or len(members) > MAX_BATCH:
            raise ValueError(f"a batch reserves 1 to {MAX_BATCH} members, not {len(members)}")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        allocators: list[Allocator] = []
        for member, claim in members:
            try:
                self._checked(gang_id, member, claim, ttl_seconds)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                allocators.append(self._allocator_for(claim, left))
            except ValueError as e:
                raise MemberInvalid(member, str(e)) from e
        with self._lock:
            self._expire()
            inventory = self._inventory()
            got: list[Reservation] = []
            try:
                for (member, claim), allocator in zip(members, allocators, strict=True):
                    try:  # the usage read anew: it counts the members reserved before this one
                        fit = allocator.allocate(inventory, self._usage_with_reservations(), claim)
                    except NoFit as e:
                        raise MemberNoFit(member, str(e)) from e
                    except ValueError as e:
                        raise MemberInvalid(member, str(e)) from e
                    r = Reservation(self._new_id(), gang_id, member, fit, self._clock() + ttl_seconds)
                    self._live[r.id] = r
                    got.append(r)
            except BaseException:
                for r in got:
                    del self._live[r.id]
                raise
            finally:
                if got:
                    self._changed()
            return got

    def _lost(self, r: Reservation, holders: Mapping[str, Collection[str]]) -> dict[str, list[str]]:
        """r's devices someone else now holds, and who (empty when r holds all its devices still)."""
        sharers = self._sharers() if r.fit.shared_milli else {}
        return {
            d: others
            for d in sorted(r.fit.all_devices)
            if (others := self._others(d, r.claim, r, self._by_device, holders, sharers=sharers))
        }

    def confirm(self, reservation_id: str) -> Reservation:
        """Keep the devices past the TTL (the allocation is being committed). Fails once expired, and when
        another claim now holds one of its devices (ReservationLost: the reservation ends)."""
        return self.confirm_many([reservation_id])[0]

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        """Confirm every one of these reservations, or none: UnknownReservation for the first one expired or
        unknown; ReservationLost for the first one another claim took a device from (that one ends)."""
        with self._lock:
            self._expire()
            holders = self._holders()
            for rid in reservation_ids:
                r = self._live.get(rid)
                if r is None:
                    raise UnknownReservation(rid)
                lost = self._lost(r, holders)
                if lost:
                    del self._live[rid]
                    self._changed()
                    raise ReservationLost(
                        f"reservation {rid} no longer holds "
                        + "; ".join(f"{d} (held by {', '.join(o)})" for d, o in lost.items())
                    )
            held_until = self._clock() + self._hold_confirmed if self._hold_confirmed is not None else math.inf
            out = []
            for rid in reservation_ids:
                r = self._live[rid] = dataclasses.replace(self._live[rid], confirmed=True, expires_at=held_until)
                out.append(r)
            self._changed()
            self._settle()  # the claims may be seen already
            return out

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        """Free one reservation, or every one of a gang; returns how many were freed."""
        if bool(reservation_id) == bool(gang_id):
            raise ValueError("release needs exactly one of reservation_id or gang_id")
        with self._lock:
            gone = [r.id for r in self._live.values() if reservation_id in ("", r.id) and gang_id in ("", r.gang_id)]
            for rid in gone:
                del self._live[rid]
            self._changed()
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


class Authenticator(Protocol):
    """Says whether a bearer token may call the node's reservation API: raises Unauthenticated when not, and
    NodeUnavailable when it cannot tell now (the API server did not answer a TokenReview)."""

    def authenticate(self, bearer: str | None) -> None: ...


class SharedToken:
    """An Authenticator for one fixed token: the simulator and tests, where no API server issues tokens."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the node allocator needs a token: anonymous reservations are not allowed")
        self._token = token

    def authenticate(self, bearer: str | None) -> None:
        if not token_matches(bearer, self._token):
            raise Unauthenticated("missing or wrong bearer token")


class NodeAllocatorService:
    """The authenticated node-side API; every transport calls this with the bearer token it received."""

    def __init__(self, book: ReservationBook, auth: str | Authenticator) -> None:
        """`auth`: who may call (a str: that one shared token)."""
        self.book = book
        self._auth = SharedToken(auth) if isinstance(auth, str) else auth

    def authenticate(self, bearer: str | None) -> None:
        """Raises Unauthenticated unless `bearer` may call: every transport calls it before it reads anything
        else of the request."""
        self._auth.authenticate(bearer)

    def reserve(  # noqa: PLR0917 (the protocol's fields, in the order the message has them)
        self,
        bearer: str | None,
        gang_id: str,
        member: str,
        claim: Claim,
        ttl_seconds: float,
        timeout_s: float | None = None,
    ) -> Reservation:
        self.authenticate(bearer)
        return self.book.reserve(gang_id, member, claim, ttl_seconds, timeout_s)

    def reserve_many(
        self,
        bearer: str | None,
        gang_id: str,
        members: Sequence[tuple[str, Claim]],
        ttl_seconds: float,
        timeout_s: float | None = None,
    ) -> list[Reservation]:
        self.authenticate(bearer)
        return self.book.reserve_many(gang_id, members, ttl_seconds, timeout_s)

    def confirm(self, bearer: str | None, reservation_id: str) -> Reservation:
        self.authenticate(bearer)
        return self.book.confirm(reservation_id)

    def confirm_many(self, bearer: str | None, reservation_ids: Sequence[str]) -> list[Reservation]:
        self.authenticate(bearer)
        return self.book.confirm_many(reservation_ids)

    def release(self, bearer: str | None, reservation_id: str = "", gang_id: str = "") -> int:
        self.authenticate(bearer)
        return self.book.release(reservation_id, gang_id)

    def capacity(self, bearer: str | None) -> CapacitySummary:
        self.authenticate(bearer)
        return self.book.capacity()


class NodeClient(Protocol):
    """What the arbiter calls on one node, whatever the transport. Reserve raises NoFit when it cannot.
    reserve_many and confirm_many: a gang's members on this node in one call, all or none (ReservationBook's);
    a client whose node cannot batch does it member by member (`reserve_each`, `confirm_each`)."""

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation: ...
    def reserve_many(
        self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float
    ) -> list[Reservation]: ...
    def confirm(self, reservation_id: str) -> Reservation: ...
    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]: ...
    def release(self, reservation_id: str = "", gang_id: str = "") -> int: ...
    def capacity(self) -> CapacitySummary: ...


class InProcessClient:
    """Direct calls into a node's service, carrying a token like the real transport does."""

    def __init__(self, service: NodeAllocatorService, token: str | None) -> None:
        self._service = service
        self._token = token

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        return self._service.reserve(self._token, gang_id, member, claim, ttl_seconds)

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        return self._service.reserve_many(self._token, gang_id, members, ttl_seconds)

    def confirm(self, reservation_id: str) -> Reservation:
        return self._service.confirm(self._token, reservation_id)

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        return self._service.confirm_many(self._token, reservation_ids)

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        return self._service.release(self._token, reservation_id, gang_id)

    def capacity(self) -> CapacitySummary:
        return self._service.capacity(self._token)


ReserveOne = Callable[[str, str, Claim, float], Reservation]  # (gang_id, member, claim, ttl_seconds)


def reserve_each(
    reserve: ReserveOne,
    release: Callable[[str], object],
    gang_id: str,
    members: Sequence[tuple[str, Claim]],
    ttl_seconds: float,
) -> list[Reservation]:
    """reserve_many for a node that reserves one member a call: all or none, the refused member named as the
    node's ReserveMembers names it; what was reserved is released (best effort: its TTL frees it otherwise)."""
    got: list[Reservation] = []
    try:
        for member, claim in members:
            try:
                got.append(reserve(gang_id, member, claim, ttl_seconds))
            except (MemberInvalid, MemberNoFit, InvalidDeviceName):  # a device named badly: the node's fault
                raise
            except NoFit as e:
                raise MemberNoFit(member, str(e)) from e
            except ValueError as e:
                raise MemberInvalid(member, str(e)) from e
    except BaseException:
        for r in got:
            try:
                release(r.id)
            except (UnknownReservation, Unauthenticated, OSError):
                continue
        raise
    return got


def confirm_each(confirm: Callable[[str], Reservation], reservation_ids: Sequence[str]) -> list[Reservation]:
    """confirm_many for a node that confirms one reservation a call: stops at the first that fails (the caller
    releases them all then)."""
    return [confirm(rid) for rid in reservation_ids]


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
# Why a node refused a Reserve, by what it raised: NoFit (the member does not fit: the node's devices are taken,
# perhaps by stale reservations of this very gang), NodeBusy (the node sheds load: try later), NodeUnavailable or
# another OSError (not reached), Unauthenticated, UnknownReservation; unknown-node: no client for the node.
RefusalKind = Literal["no-fit", "busy", "unavailable", "unauthenticated", "unknown-reservation", "unknown-node"]


@dataclass(frozen=True)
class Refused:
    """The first refusal that stopped a gang's reserve_all: its kind, for the caller to act on, and in words."""

    kind: RefusalKind
    reason: str  # names the member or the node, for an Event


def _batches(by_node: Mapping[str, Sequence[T]]) -> Iterator[tuple[str, Sequence[T]]]:
    """Each node's items in calls of at most MAX_BATCH (shares of 8 GPUs may be more members than that)."""
    for node, items in by_node.items():
        for i in range(0, len(items), MAX_BATCH):
            yield node, items[i : i + MAX_BATCH]


def _refusal(error: Exception) -> RefusalKind:
    if isinstance(error, NodeBusy):
        return "busy"
    if isinstance(error, Unauthenticated):
        return "unauthenticated"
    if isinstance(error, UnknownReservation):
        return "unknown-reservation"
    return "unavailable"


class GangCoordinator:
    """Two-phase gang placement across nodes: reserve all, then confirm all, or release all.

    `place` does both phases at once (the simulator); the controller calls `reserve_all`, writes the claims,
    then `confirm_all`, releasing everything with `release_all` when any step fails."""

    def __init__(self, nodes: Mapping[str, NodeClient]) -> None:
        self.nodes = nodes

    def place(self, gang_id: str, members: Sequence[MemberPlacement], ttl_seconds: float) -> GangOutcome:
        held, refused = self.reserve_all(gang_id, members, ttl_seconds)
        if refused is not None:
            return GangOutcome(False, {}, refused.reason)
        reason = self.confirm_all(held)
        if reason:
            return GangOutcome(False, {}, reason)
        return GangOutcome(True, held)

    def reserve_all(
        self, gang_id: str, members: Sequence[MemberPlacement], ttl_seconds: float
    ) -> tuple[Held, Refused | None]:
        """Reserve every member on its node, one call per node (its members in their order); on the first
        refusal release what was got and say why (Refused)."""
        by_node: dict[str, list[MemberPlacement]] = {}
        for m in members:
            by_node.setdefault(m.node, []).append(m)
        held: Held = {}
        refused: Refused | None = None
        try:
            for node, group in _batches(by_node):
                client = self.nodes.get(node)
                if client is None:
                    refused = Refused("unknown-node", f"member {group[0].member}: unknown node {node}")
                    break
                try:
                    got = client.reserve_many(gang_id, [(m.member, m.claim) for m in group], ttl_seconds)
                except MemberNoFit as e:
                    refused = Refused("no-fit", f"member {e.member} does not fit on {node}: {e}")
                    break
                except NoFit as e:
                    refused = Refused("no-fit", f"members on {node} do not fit: {e}")
                    break
                except (UnknownReservation, Unauthenticated, OSError) as e:
                    refused = Refused(_refusal(e), f"node {node}: {type(e).__name__}: {e}")
                    break
                for m, r in zip(group, got, strict=True):
                    held[m.member] = (node, r)
        except BaseException:
            self.release_all(held)
            raise
        if refused is not None:
            self.release_all(held)
            return {}, refused
        return held, None

    def confirm_all(self, held: Held) -> str:
        """Confirm every reservation, one call per node ("" on success); on failure release all and say why."""
        by_node: dict[str, list[str]] = {}
        for node, r in held.values():
            by_node.setdefault(node, []).append(r.id)
        node = ""
        try:
            for node, ids in _batches(by_node):
                self.nodes[node].confirm_many(ids)
        except (UnknownReservation, Unauthenticated, OSError) as e:
            self.release_all(held)
            return f"node {node}: {type(e).__name__}: {e}"
        except BaseException:
            self.release_all(held)
            raise
        # what reserve returned, confirmed: a transport's confirm need not echo the devices (gRPC's doesn't)
        for member, (node, r) in list(held.items()):
            held[member] = (node, dataclasses.replace(r, confirmed=True))
        return ""

    def release_all(self, held: Mapping[str, tuple[str, Reservation]]) -> None:
        for node, r in held.values():
            try:
                self.nodes[node].release(reservation_id=r.id)
            except (UnknownReservation, Unauthenticated, OSError):
                continue  # already gone, unreachable or refusing us: its TTL frees it
