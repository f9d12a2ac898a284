"""The node agent's side of the reservation protocol: an authenticated gRPC server over the local allocator.

The allocator counts as taken every device that is allocated (in a ResourceClaim's `status.allocation` for
this node's pool, from a claim informer), prepared (in the claim checkpoint: a terminating pod's devices stay
busy until unprepared), reserved (the book), or unhealthy.

Where the arbiter finds it: the agent writes its address into its Node's annotation
`scheduling.gpu-dra-agent.io/reservation-address`, and beside it, in
`scheduling.gpu-dra-agent.io/reservation-certificate-sha256`, the fingerprint of the TLS certificate it made at
start (a new key each start, kept in memory only): the Node is written through the authenticated API server,
so the arbiter can trust the pair, and connects only to the server that shows that certificate. The arbiter
already watches Nodes (capacity, readiness), so the address arrives with the object it needs anyway and
goes with the Node when it is deleted; a ResourceSlice would be the wrong home (its content is the driver's
device model, validated per device, and every extra field there is re-published with each pool generation).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent import futures

import grpc

from agent.allocation.allocator import Allocator
from agent.allocation.catalog import NodeUsage
from agent.allocation.fragmentation import MILLI
from agent.allocation.selectors import CelSelectors
from agent.devices.model import Inventory
from agent.devices.names import gpu_device_name
from agent.devices.shares import ShareMode, capacities
from agent.jsontypes import Json
from agent.kube.errors import ApiError
from agent.kube.informer import Informer
from agent.kube.rest import NODES, RESOURCE_CLAIMS, Rest
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION
from agent.objects.read import allocated_devices, allocated_shares, share_gpus
from agent.reservation import transport as reservation_grpc
from agent.reservation.protocol import Authenticator, NodeAllocatorService, ReservationBook
from agent.reservation.selector_worker import MAX_ADMITTED, WorkerSelectors

log = logging.getLogger(__name__)

HOLD_CONFIRMED_S = 60.0  # see ReservationBook: the claim is in the API before the arbiter confirms
POOL_INDEX = "pool"
CERTIFICATE_DAYS = 366  # the agent makes a new one at every start; a year outlives any one run
SERVER_THREADS = 8
# Reserves with selectors may hold MAX_ADMITTED threads; the rest answer Capacity, Confirm and Release
assert MAX_ADMITTED <= SERVER_THREADS - 2


def self_signed(node_name: str, host: str) -> tuple[bytes, bytes]:
    """A new P-256 key and a self-signed certificate for this node's reservation server (PEM key, PEM
    certificate). Its names: the node name (the arbiter checks that one) and the advertised host."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_name)])
    alt: list[x509.GeneralName] = [x509.DNSName(node_name)]
    try:
        alt.append(x509.IPAddress(ipaddress.ip_address(host)))
    except ValueError:
        if host != node_name:
            alt.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERTIFICATE_DAYS))
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def claim_pools(driver: str) -> Callable[[Json], Iterable[str]]:
    """Indexer: the pools (nodes) a claim's allocation takes `driver`'s devices from."""
    return lambda claim: {pool for pool, _ in allocated_devices(claim, driver)}


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--reservation-addr must be HOST:PORT, not {address!r}")
    return host or "0.0.0.0", int(port)


def advertised(host: str, port: int, node_ip: str | None) -> str:
    """The address others dial: the node IP when listening on every interface."""
    if host in ("0.0.0.0", "::", ""):
        host = node_ip or socket.gethostname()
    return f"{host}:{port}"


class NodeReservations:
    """Serves Reserve/Confirm/Release/Capacity for one node and advertises where."""

    def __init__(
        self,
        *,
        node_name: str,
        driver: str,
        inventory: Callable[[], Inventory],
        prepared: Callable[[], Iterable[tuple[str, str]]],
        unhealthy: Callable[[], Iterable[str]],
        token: str | Authenticator,
        rest: Rest,
        clock: Callable[[], float] = time.time,
        claims: Informer | None = None,
        share_mode: ShareMode | None = None,
        selectors: WorkerSelectors | None = None,
    ) -> None:
        """`token`: who may call (agent.reservation.auth.TokenReviewer; a str: one shared token, for
        tests). `prepared`: (device, "namespace/name" of its claim) of every device prepared here. `claims`: an
        informer shared by several nodes in one process (fakes), indexed with `claim_pools` and calling
        `claim_seen` of the nodes its claims name; by default the node watches claims itself. `share_mode`:
        the capacities the node publishes its GPUs with (`--consumable-shares`), what a share is counted of."""
        self.node_name = node_name
        self._share_mode = share_mode
        self._driver = driver
        self._inventory = inventory
        self._prepared = prepared
        self._unhealthy = unhealthy
        self._rest = rest
        self._own_claims = claims is None
        self._claims = claims or Informer(
            rest,
            RESOURCE_CLAIMS,
            indexers={POOL_INDEX: claim_pools(driver)},
            on_event=lambda _type, claim: self.claim_seen(claim),
        )
        self._selectors = selectors or WorkerSelectors()
        self.book = ReservationBook(
            inventory,
            self.usage,
            Allocator(CelSelectors()),
            clock,
            lambda: uuid.uuid4().hex,
            hold_confirmed_s=HOLD_CONFIRMED_S,
            holders=self.holders,
            sharers=self.sharers,
            evaluator=self._selectors,
        )
        self.service = NodeAllocatorService(self.book, token)
        self._server: grpc.Server | None = None
        self.port = 0
        self.certificate = b""  # PEM, made at start

    def claim_seen(self, claim: Json) -> None:
        """A claim changed: if it now holds devices of this node, a confirmed reservation for them ends."""
        if any(pool == self.node_name for pool, _ in allocated_devices(claim, self._driver)):
            self.book.settle()

    def usage(self) -> NodeUsage:
        """What claims hold here: whole devices, and the GPU fraction consumable-capacity shares took (at least a
        milli-GPU each, so a GPU with any share is never offered whole)."""
        allocated: set[str] = set()
        shared: dict[str, int] = {}
        published: dict[str, dict[str, float]] | None = None  # read once, and only when a share is allocated
        for claim in self._claims.by_index(POOL_INDEX, self.node_name):
            allocated.update(
                device
                for pool, device in allocated_devices(claim, self._driver, shares=False)
                if pool == self.node_name
            )
            for pool, device, consumed in allocated_shares(claim, self._driver):
                if pool == self.node_name:
                    if published is None:
                        published = {
                            gpu_device_name(g.minor): self._capacities(g.memory_bytes) for g in self._inventory().gpus
                        }
                    milli = math.ceil(share_gpus(consumed, published.get(device)) * MILLI)
                    shared[device] = min(MILLI, shared.get(device, 0) + max(1, milli))
        return NodeUsage(
            allocated=frozenset(allocated),
            prepared=frozenset(d for d, _ in self._prepared()),
            unhealthy=frozenset(self._unhealthy()),
            shared_milli=shared,
        )

    def _capacities(self, memory_bytes: int) -> dict[str, float]:
        """A GPU's published capacities: a share counts as the largest part it consumed of any (its memory,
        or one of N shares), as the arbiter counts it."""
        if self._share_mode is None:
            return {"memory": float(memory_bytes)}
        return {name: float(c.value) for name, c in capacities(memory_bytes, self._share_mode).items()}

    def holders(self) -> Mapping[str, Collection[str]]:
        """device -> the claims ("namespace/name") allocated it on this node or prepared with it here."""
        out = self._allocated_to(lambda claim: allocated_devices(claim, self._driver))
        for device, claim_key in self._prepared():
            out.setdefault(device, set()).add(claim_key)
        return out

    def sharers(self) -> Mapping[str, Collection[str]]:
        """device -> the claims ("namespace/name") allocated a consumable-capacity share of it on this node."""
        return self._allocated_to(lambda claim: [(p, d) for p, d, _ in allocated_shares(claim, self._driver)])

    def _allocated_to(self, devices: Callable[[Json], Iterable[tuple[str, str]]]) -> dict[str, set[str]]:
        """device -> the claims ("namespace/name") whose allocation `devices` (pool, device) names it on this node."""
        out: dict[str, set[str]] = {}
        for claim in self._claims.by_index(POOL_INDEX, self.node_name):
            m = claim.get("metadata") or {}
            for pool, device in devices(claim):
                if pool == self.node_name:
                    out.setdefault(device, set()).add(f"{m.get('namespace')}/{m.get('name')}")
        return out

    def start(self, address: str, node_ip: str | None = None, sync_timeout: float = 30.0) -> str:
        """Start the claim informer and the server; write the address to the Node. Returns the address."""
        if self._own_claims:
            self._claims.start()
        if not self._claims.wait_synced(sync_timeout):
            raise ApiError(0, f"could not list ResourceClaims within {sync_timeout:.0f}s")
        host, port = split_address(address)
        advertised_host = advertised(host, port, node_ip).rpartition(":")[0]
        key, self.certificate = self_signed(self.node_name, advertised_host)
        server = grpc.server(
            futures.ThreadPoolExecutor(SERVER_THREADS, thread_name_prefix="reservations"),
            interceptors=[reservation_grpc.TokenInterceptor(self.service)],
        )
        reservation_grpc.add_to_server(self.service, server)
        self.port = server.add_secure_port(f"{host}:{port}", grpc.ssl_server_credentials([(key, self.certificate)]))
        if not self.port:
            raise OSError(f"cannot listen on {address} for the reservation API")
        server.start()
        self._server = server
        where = advertised(host, self.port, node_ip)
        sha256 = reservation_grpc.fingerprint(self.certificate.decode())
        self._rest.patch(
            NODES,
            None,
            self.node_name,
            {"metadata": {"annotations": {ADDRESS_ANNOTATION: where, FINGERPRINT_ANNOTATION: sha256}}},
        )
        log.info("reservation API serving over TLS", extra={"address": where, "certificate_sha256": sha256})
        return where

    def stop(self) -> None:
        if self._own_claims:
            self._claims.stop()
        if self._server is not None:
            done: threading.Event = self._server.stop(1.0)
            done.wait(2.0)
        self._selectors.close()
