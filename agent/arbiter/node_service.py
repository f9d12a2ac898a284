"""The node agent's side of the reservation protocol: an authenticated gRPC server over the local allocator.

The allocator counts as taken every device that is allocated (in a ResourceClaim's `status.allocation` for
this node's pool, from a claim informer), prepared (in the claim checkpoint: a terminating pod's devices stay
busy until unprepared), reserved (the book), or unhealthy.

Where the arbiter finds it: the agent writes its address into its Node's annotation
`scheduling.gpu-dra-agent.io/reservation-address`. The arbiter already watches Nodes (capacity, readiness),
so the address arrives with the object it needs anyway and goes with the Node when it is deleted; a
ResourceSlice would be the wrong home (its content is the driver's device model, validated per device, and
every extra field there is re-published with each pool generation).
"""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent import futures
from pathlib import Path

import grpc

from agent.allocation.allocator import Allocator
from agent.allocation.catalog import NodeUsage
from agent.allocation.fragmentation import MILLI
from agent.allocation.selectors import CelSelectors
from agent.arbiter import reservation_grpc
from agent.arbiter.names import ADDRESS_ANNOTATION
from agent.arbiter.reservation import NodeAllocatorService, ReservationBook
from agent.arbiter.world import Json, allocated_devices, allocated_shares, share_gpus
from agent.devices.model import Inventory
from agent.devices.names import gpu_device_name
from agent.kube.errors import ApiError
from agent.kube.informer import Informer
from agent.kube.rest import NODES, RESOURCE_CLAIMS, Rest

log = logging.getLogger(__name__)

HOLD_CONFIRMED_S = 60.0  # see ReservationBook: the claim is in the API before the arbiter confirms
POOL_INDEX = "pool"


def claim_pools(driver: str) -> Callable[[Json], Iterable[str]]:
    """Indexer: the pools (nodes) a claim's allocation takes `driver`'s devices from."""
    return lambda claim: {pool for pool, _ in allocated_devices(claim, driver)}


class TokenFileError(ValueError):
    """The token file is missing, unreadable or empty."""


def read_token(path: str | Path) -> str:
    """The shared bearer token: the file's content without surrounding whitespace; never empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TokenFileError(f"cannot read the reservation token file {path}: {e.strerror or e}") from e
    if not token:
        raise TokenFileError(f"the reservation token file {path} is empty: anonymous reservations are not allowed")
    return token


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

    def __init__(self, *, node_name: str, driver: str, inventory: Callable[[], Inventory],
                 prepared: Callable[[], Iterable[str]], unhealthy: Callable[[], Iterable[str]], token: str,
                 rest: Rest, clock: Callable[[], float] = time.time, claims: Informer | None = None) -> None:
        """`claims`: an informer shared by several nodes in one process (fakes), indexed with `claim_pools`
        and calling `claim_seen` of the nodes its claims name; by default the node watches claims itself."""
        self.node_name = node_name
        self._driver = driver
        self._inventory = inventory
        self._prepared = prepared
        self._unhealthy = unhealthy
        self._rest = rest
        self._own_claims = claims is None
        self._claims = claims or Informer(rest, RESOURCE_CLAIMS, indexers={POOL_INDEX: claim_pools(driver)},
                                          on_event=lambda _type, claim: self.claim_seen(claim))
        self.book = ReservationBook(inventory, self.usage, Allocator(CelSelectors()), clock,
                                    lambda: uuid.uuid4().hex, hold_confirmed_s=HOLD_CONFIRMED_S)
        self.service = NodeAllocatorService(self.book, token)
        self._server: grpc.Server | None = None
        self.port = 0

    def claim_seen(self, claim: Json) -> None:
        """A claim changed: if it now holds devices of this node, a confirmed reservation for them ends."""
        if any(pool == self.node_name for pool, _ in allocated_devices(claim, self._driver)):
            self.book.settle()

    def usage(self) -> NodeUsage:
        """What claims hold here: whole devices, and the GPU fraction consumable-capacity shares took (at least a
        milli-GPU each, so a GPU with any share is never offered whole)."""
        claims = self._claims.by_index(POOL_INDEX, self.node_name)
        allocated = frozenset(
            device for claim in claims
            for pool, device in allocated_devices(claim, self._driver, shares=False) if pool == self.node_name
        )
        memory = {gpu_device_name(g.minor): float(g.memory_bytes) for g in self._inventory().gpus}
        shared: dict[str, int] = {}
        for claim in claims:
            for pool, device, consumed in allocated_shares(claim, self._driver):
                if pool == self.node_name:
                    milli = math.ceil(share_gpus(consumed, {"memory": memory.get(device, 0.0)}) * MILLI)
                    shared[device] = min(MILLI, shared.get(device, 0) + max(1, milli))
        return NodeUsage(allocated=allocated, prepared=frozenset(self._prepared()),
                         unhealthy=frozenset(self._unhealthy()), shared_milli=shared)

    def start(self, address: str, node_ip: str | None = None, sync_timeout: float = 30.0) -> str:
        """Start the claim informer and the server; write the address to the Node. Returns the address."""
        if self._own_claims:
            self._claims.start()
        if not self._claims.wait_synced(sync_timeout):
            raise ApiError(0, f"could not list ResourceClaims within {sync_timeout:.0f}s")
        host, port = split_address(address)
        server = grpc.server(futures.ThreadPoolExecutor(8, thread_name_prefix="reservations"))
        reservation_grpc.add_to_server(self.service, server)
        self.port = server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen on {address} for the reservation API")
        server.start()
        self._server = server
        where = advertised(host, self.port, node_ip)
        self._rest.patch(NODES, None, self.node_name, {"metadata": {"annotations": {ADDRESS_ANNOTATION: where}}})
        log.info("reservation API serving", extra={"address": where})
        return where

    def stop(self) -> None:
        if self._own_claims:
            self._claims.stop()
        if self._server is not None:
            done: threading.Event = self._server.stop(1.0)
            done.wait(2.0)
