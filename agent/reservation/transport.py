"""The reservation protocol over gRPC (proto/arbiter.proto): a servicer for the agent, a client for the arbiter.

The bearer token (the arbiter's service-account token) travels as metadata `authorization: Bearer <token>`,
exactly once, over TLS: the arbiter trusts exactly the certificate whose SHA-256 fingerprint the node published
on its Node (`pinned_channel`), so the token never reaches a server without that certificate's key. The token
is checked before the request is even parsed (`TokenInterceptor`). The servicer maps errors to codes:
UNAUTHENTICATED, RESOURCE_EXHAUSTED (does not fit; or, with trailing metadata `gpu-dra-agent-busy`, the node
is busy evaluating other Reserves' selectors), NOT_FOUND (unknown or expired), FAILED_PRECONDITION (Confirm:
another claim took a device), INVALID_ARGUMENT (a bad request or selector), DEADLINE_EXCEEDED (selectors
outlasted the caller's deadline), UNAVAILABLE (the node cannot check the token now).
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from agent._proto import arbiter_pb2 as pb
from agent._proto import arbiter_pb2_grpc as pb_grpc
from agent.allocation.allocator import Claim, DeviceRequest, Fit, NoFit
from agent.allocation.capacity import CapacitySummary
from agent.devices.names import parse_device_name
from agent.reservation.protocol import (
    MemberInvalid,
    MemberNoFit,
    NodeAllocatorService,
    NodeBusy,
    NodeUnavailable,
    Reservation,
    ReservationLost,
    Unauthenticated,
    UnknownReservation,
    claim_of,
    confirm_each,
    reserve_each,
)

T = TypeVar("T")
BEARER = "bearer "
BUSY = "gpu-dra-agent-busy"  # trailing metadata on a RESOURCE_EXHAUSTED that means "busy", not "does not fit"
MEMBER = "gpu-dra-agent-member"  # trailing metadata of a refused ReserveMembers: the member refused


class Unimplemented(NodeUnavailable):
    """The node does not know the method: an agent older than it (UNIMPLEMENTED)."""


def claim_from_pb(req: pb.ReserveRequest, batch: pb.ReserveRequest | None = None) -> Claim:
    """The request as the allocator reads it; ValueError for one that asks for nothing it could mean. proto3
    cannot tell a count of 0 from none: both are refused (the arbiter always sends the count). `batch`: the
    first member of its ReserveMembers, whose gang and TTL every member names."""
    if batch is not None and (req.gang_id, req.ttl_seconds) != (batch.gang_id, batch.ttl_seconds):
        raise ValueError("every member of one ReserveMembers names the same gang_id and ttl_seconds")
    if claim_of(req.member) is None:
        raise ValueError(
            f"member must be <namespace>/<pod>/<claim>, the ResourceClaim the devices are for, not "
            f"{req.member!r}: a reservation tied to no claim would block every prepare of its devices"
        )
    for r in req.requests:
        if r.count < 1:
            raise ValueError(f"request {r.name!r}: count must be at least 1, got {r.count}")
    return Claim(
        tuple(
            DeviceRequest(r.name, r.device_class, tuple(r.selectors), r.count, r.gpu_milli or None)
            for r in req.requests
        ),
        tuple(req.match_attributes),
    )


def claim_to_pb(gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> pb.ReserveRequest:
    return pb.ReserveRequest(
        gang_id=gang_id,
        member=member,
        ttl_seconds=ttl_seconds,
        match_attributes=list(claim.match_attributes),
        requests=[
            pb.DeviceRequest(
                name=r.name,
                device_class=r.device_class,
                selectors=list(r.selectors),
                count=r.count,
                gpu_milli=r.gpu_milli or 0,
            )
            for r in claim.requests
        ],
    )


def reservation_to_pb(r: Reservation) -> pb.ReserveResponse:
    devices = [
        pb.ReservedDevice(request=req, device=d, shared_milli=r.fit.shared_milli.get(d, 0))
        for req, names in r.fit.devices.items()
        for d in names
    ]
    return pb.ReserveResponse(reservation_id=r.id, devices=devices, expires_at=r.expires_at, score=r.fit.score)


def reservation_from_pb(resp: pb.ReserveResponse, gang_id: str, member: str) -> Reservation:
    """The node's answer; a device not named as the node publishes it is refused (InvalidDeviceName), since
    committing it would allocate a name that no slice offers and no prepare accepts."""
    devices: dict[str, tuple[str, ...]] = {}
    shared: dict[str, int] = {}
    for d in resp.devices:
        parse_device_name(d.device)
        devices[d.request] = (*devices.get(d.request, ()), d.device)
        if d.shared_milli:
            shared[d.device] = d.shared_milli
    return Reservation(resp.reservation_id, gang_id, member, Fit(devices, shared, resp.score), resp.expires_at)


def _bearer(metadata: Any) -> str | None:
    """The bearer token of the one `authorization` entry (None without one); Unauthenticated when there are
    two or more: which one a proxy or the server's checks would read is not for the caller to choose."""
    values = [value for key, value in metadata or () if key == "authorization"]
    if len(values) > 1:
        raise Unauthenticated(f"{len(values)} authorization headers: send exactly one")
    if values and isinstance(values[0], str) and values[0].lower().startswith(BEARER):
        return values[0][len(BEARER) :]
    return None


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """UNAUTHENTICATED for a call without the token, before its request is deserialized or validated: an
    unauthenticated caller learns nothing about what a valid request looks like."""

    def __init__(self, service: NodeAllocatorService) -> None:
        self._service = service

    @staticmethod
    def _deny(code: grpc.StatusCode, message: str) -> Any:
        def deny(_request: bytes, context: grpc.ServicerContext) -> None:
            context.abort(code, message)

        return grpc.unary_unary_rpc_method_handler(deny)  # no deserializer: the bytes stay unread

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        try:
            self._service.authenticate(_bearer(handler_call_details.invocation_metadata))
        except Unauthenticated as e:
            return self._deny(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except NodeUnavailable as e:  # the token could not be checked now (TokenReview failed)
            return self._deny(grpc.StatusCode.UNAVAILABLE, str(e))
        return continuation(handler_call_details)


class NodeAllocatorServicer(pb_grpc.NodeAllocatorServicer):
    def __init__(self, service: NodeAllocatorService) -> None:
        self.service = service

    def _call(self, context: grpc.ServicerContext, fn: Callable[[str | None], T]) -> T:
        try:
            bearer = _bearer(context.invocation_metadata())
            self.service.authenticate(bearer)  # first, also without the interceptor
            try:
                return fn(bearer)
            except (MemberInvalid, MemberNoFit) as e:
                context.set_trailing_metadata(((MEMBER, e.member),))
                raise
        except Unauthenticated as e:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, str(e))
        except NodeBusy as e:
            context.set_trailing_metadata(((BUSY, "selectors"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except NodeUnavailable as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except NoFit as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ReservationLost as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, e.args[0] if e.args else str(e))
        except UnknownReservation as e:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no live reservation {e}")
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except TimeoutError as e:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(e))
        raise AssertionError("context.abort raises")

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext) -> pb.ReserveResponse:
        def go(bearer: str | None) -> pb.ReserveResponse:
            claim = claim_from_pb(request)
            r = self.service.reserve(
                bearer, request.gang_id, request.member, claim, request.ttl_seconds, context.time_remaining()
            )
            return reservation_to_pb(r)

        return self._call(context, go)

    def ReserveMembers(
        self, request: pb.ReserveMembersRequest, context: grpc.ServicerContext
    ) -> pb.ReserveMembersResponse:
        def go(bearer: str | None) -> pb.ReserveMembersResponse:
            if not request.members:
                raise ValueError("ReserveMembers needs at least one member")
            first = request.members[0]
            members = []
            for m in request.members:
                try:
                    members.append((m.member, claim_from_pb(m, first)))
                except ValueError as e:
                    raise MemberInvalid(m.member, str(e)) from e
            got = self.service.reserve_many(bearer, first.gang_id, members, first.ttl_seconds, context.time_remaining())
            return pb.ReserveMembersResponse(reservations=[reservation_to_pb(r) for r in got])

        return self._call(context, go)

    def ConfirmMembers(
        self, request: pb.ConfirmMembersRequest, context: grpc.ServicerContext
    ) -> pb.ConfirmMembersResponse:
        self._call(context, lambda b: self.service.confirm_many(b, list(request.reservation_ids)))
        return pb.ConfirmMembersResponse()

    def Confirm(self, request: pb.ConfirmRequest, context: grpc.ServicerContext) -> pb.ConfirmResponse:
        self._call(context, lambda b: self.service.confirm(b, request.reservation_id))
        return pb.ConfirmResponse()

    def Release(self, request: pb.ReleaseRequest, context: grpc.ServicerContext) -> pb.ReleaseResponse:
        n = self._call(context, lambda b: self.service.release(b, request.reservation_id, request.gang_id))
        return pb.ReleaseResponse(released=n)

    def Capacity(self, request: pb.CapacityRequest, context: grpc.ServicerContext) -> pb.CapacitySummary:
        s = self._call(context, self.service.capacity)
        return pb.CapacitySummary(
            free_gpus_by_model=s.free_gpus_by_model,
            free_gpus_by_domain=s.free_gpus_by_domain,
            free_mig_placements=s.free_mig_placements,
            free_gpu_milli=s.free_gpu_milli,
        )


def add_to_server(service: NodeAllocatorService, server: grpc.Server) -> None:
    """The servicer on `server`; build the server with `interceptors=[TokenInterceptor(service)]`."""
    pb_grpc.add_NodeAllocatorServicer_to_server(NodeAllocatorServicer(service), server)


# --- the arbiter's side of TLS ------------------------------------------------------------------------------


class CertificateMismatch(NodeUnavailable):
    """The server's certificate is not the one its Node published: nothing is sent to it."""


def fingerprint(certificate_pem: str) -> str:
    """SHA-256 of the certificate's DER bytes, lowercase hex (as the Node annotation carries it)."""
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(certificate_pem)).hexdigest()


def pinned_channel(address: str, expected: str, server_name: str, timeout_s: float = 5.0) -> grpc.Channel:
    """A TLS channel to `address` that trusts only the certificate whose fingerprint is `expected`.

    gRPC has no fingerprint check of its own, so the server's certificate is read first (a handshake that
    sends nothing), compared with `expected`, and then made the channel's only root: the channel's own
    handshake proves the server holds that certificate's key, and a server showing any other is refused by
    gRPC before a call (and its token) goes out. `server_name` must be in the certificate (the agent puts its
    node name there). Raises CertificateMismatch or NodeUnavailable."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not expected:
        raise CertificateMismatch(f"{server_name} publishes no certificate fingerprint: not connecting to {address}")
    try:
        pem = ssl.get_server_certificate((host, int(port)), timeout=timeout_s)
    except (OSError, ValueError) as e:
        raise NodeUnavailable(f"cannot read the certificate of {server_name} at {address}: {e}") from e
    got = fingerprint(pem)
    if not hmac.compare_digest(got.encode(), expected.lower().encode()):
        raise CertificateMismatch(
            f"{address} shows a certificate with SHA-256 {got}, not the {expected} that "
            f"{server_name} published: not connecting"
        )
    return trusting_channel(address, pem, server_name)


def trusting_channel(address: str, certificate_pem: str, server_name: str) -> grpc.Channel:
    """A TLS channel whose only trusted certificate is `certificate_pem`, checked for `server_name`."""
    credentials = grpc.ssl_channel_credentials(root_certificates=certificate_pem.encode())
    return grpc.secure_channel(address, credentials, options=(("grpc.ssl_target_name_override", server_name),))


class GrpcNodeClient:
    """NodeClient over a gRPC channel: RESOURCE_EXHAUSTED -> NoFit (NodeBusy when marked busy), NOT_FOUND ->
    UnknownReservation, FAILED_PRECONDITION -> ReservationLost, UNAUTHENTICATED -> Unauthenticated; any other
    failure (unreachable, deadline, a TLS handshake refused) -> NodeUnavailable.

    A refused ReserveMembers raises MemberNoFit or MemberInvalid naming the member; a node that answers it
    UNIMPLEMENTED (an older agent) is from then on called member by member, the same client being kept for as
    long as the node's agent runs (a restarted agent has a new certificate, hence a new client).

    `token`: the bearer token, or what reads it anew for each call (a projected token rotates)."""

    def __init__(self, channel: grpc.Channel, token: str | Callable[[], str], timeout_s: float = 5.0) -> None:
        self._stub = pb_grpc.NodeAllocatorStub(channel)
        self._token = token if callable(token) else lambda: token
        self._timeout = timeout_s
        self.batches = True  # until the node answers a batch UNIMPLEMENTED

    def _rpc(self, method: Callable[..., T], request: object, calls: int = 1) -> T:
        """`calls`: how many single calls this one stands for (a batch's members): its deadline is theirs."""
        try:
            metadata = (("authorization", f"Bearer {self._token()}"),)
        except (OSError, ValueError) as e:  # the token file is gone or empty: nothing is sent without it
            raise Unauthenticated(f"no token to send: {e}") from e
        try:
            return method(request, metadata=metadata, timeout=self._timeout * calls)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            trailing: dict[str, Any] = dict((e.trailing_metadata() or ()) if isinstance(e, grpc.Call) else ())
            member = trailing.get(MEMBER)
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                if BUSY in trailing:
                    raise NodeBusy(f"node busy, try again later: {detail}") from e
                raise NoFit(detail) if member is None else MemberNoFit(str(member), detail) from e
            if code == grpc.StatusCode.INVALID_ARGUMENT and member is not None:
                raise MemberInvalid(str(member), detail) from e
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise Unimplemented(detail) from e
            if code == grpc.StatusCode.NOT_FOUND:
                raise UnknownReservation(detail) from e
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise ReservationLost(detail) from e
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated(detail) from e
            raise NodeUnavailable(f"{code.name if code else 'RPC failed'}: {detail}") from e

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        resp = self._rpc(self._stub.Reserve, claim_to_pb(gang_id, member, claim, ttl_seconds))
        return reservation_from_pb(resp, gang_id, member)

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        if self.batches:
            request = pb.ReserveMembersRequest(members=[claim_to_pb(gang_id, m, c, ttl_seconds) for m, c in members])
            try:
                resp = self._rpc(self._stub.ReserveMembers, request, len(members))  # each its selectors' time
            except Unimplemented:
                self.batches = False
            else:
                return self._reservations(resp, gang_id, [m for m, _ in members])
        return reserve_each(self._reserve_one, self.release, gang_id, members, ttl_seconds)

    def _reservations(self, resp: pb.ReserveMembersResponse, gang_id: str, members: list[str]) -> list[Reservation]:
        """The batch's answer, one reservation a member; on an answer the arbiter cannot use, what the node
        reserved is released and the node blamed."""
        if len(resp.reservations) != len(members):
            self._release_ids([r.reservation_id for r in resp.reservations])
            raise NodeUnavailable(f"{len(resp.reservations)} reservations answered for {len(members)} members")
        try:
            return [reservation_from_pb(r, gang_id, m) for r, m in zip(resp.reservations, members, strict=True)]
        except BaseException:
            self._release_ids([r.reservation_id for r in resp.reservations])
            raise

    def _release_ids(self, reservation_ids: Sequence[str]) -> None:
        for rid in reservation_ids:
            try:
                self.release(rid)
            except (UnknownReservation, Unauthenticated, OSError):
                continue  # its TTL frees it

    def _reserve_one(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        """Reserve, as a batch's fallback: INVALID_ARGUMENT is the member's claim's error (MemberInvalid)."""
        try:
            return self.reserve(gang_id, member, claim, ttl_seconds)
        except NodeUnavailable as e:
            cause = e.__cause__
            if isinstance(cause, grpc.Call) and cause.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise MemberInvalid(member, cause.details() or str(e)) from e
            raise

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        if self.batches:
            try:
                self._rpc(self._stub.ConfirmMembers, pb.ConfirmMembersRequest(reservation_ids=list(reservation_ids)))
            except Unimplemented:
                self.batches = False
            else:
                return [Reservation(rid, "", "", Fit({}), 0.0, confirmed=True) for rid in reservation_ids]
        return confirm_each(self.confirm, reservation_ids)

    def confirm(self, reservation_id: str) -> Reservation:
        """ConfirmResponse carries nothing: the Reservation returned has the id and `confirmed` only."""
        self._rpc(self._stub.Confirm, pb.ConfirmRequest(reservation_id=reservation_id))
        return Reservation(reservation_id, "", "", Fit({}), 0.0, confirmed=True)

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        req = pb.ReleaseRequest(reservation_id=reservation_id) if reservation_id else pb.ReleaseRequest(gang_id=gang_id)
        return int(self._rpc(self._stub.Release, req).released)

    def capacity(self) -> CapacitySummary:
        s = self._rpc(self._stub.Capacity, pb.CapacityRequest())
        return CapacitySummary(
            dict(s.free_gpus_by_model), dict(s.free_gpus_by_domain), dict(s.free_mig_placements), int(s.free_gpu_milli)
        )
