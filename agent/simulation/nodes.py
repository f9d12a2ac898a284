"""The simulator's nodes: every round's newly bound gangs are committed through the reservation protocol.

The arbiter decides who goes where; each node's local allocator, behind an authenticated NodeAllocatorService,
must then reserve concrete devices. A gang stays bound only when every member is reserved on its node
(GangCoordinator: reserve all, confirm all, or release all). A gang a node refuses goes back to pending
(action "keep", the reason in `CommitStats.refused_pods`): that only happens when the arbiter's view of a node
and the node's own disagree (a GPU gone unhealthy, a node unreachable, a wrong token). A pod holds its devices
until it stops running (evicted, released); pods already running in the snapshot hold theirs from the start.

Which GPUs: the snapshot records GPU indices for fractional pods only, so each round the arbiter places running
whole-GPU pods afresh and may name other GPUs than a node really gave them. Each round therefore maps the
arbiter's GPU indices onto the node's (the same use per GPU, identity wherever both views agree) and asks the
node for exactly the mapped devices first; only when it cannot give them does its allocator choose freely. A
fractional pod's `gpuIndex` is then the GPU the node reserved, and the next round starts from it.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.allocation.allocator import Allocator, Claim, DeviceRequest
from agent.allocation.catalog import DRIVER, NodeUsage
from agent.allocation.fragmentation import MILLI
from agent.allocation.selectors import CelSelectors
from agent.arbiter.core.cycle import CycleResult, PodDecision
from agent.arbiter.core.model import NodeSpec, PodSpec
from agent.devices.model import Gpu, Inventory
from agent.devices.names import gpu_device_name
from agent.devices.topology import assign_nvlink_domains
from agent.reservation.protocol import (
    Clock,
    GangCoordinator,
    InProcessClient,
    MemberPlacement,
    NodeAllocatorService,
    NodeClient,
    ReservationBook,
)

DEFAULT_TTL_SECONDS = 30.0
Connect = Callable[[NodeAllocatorService, str], NodeClient]  # (service, the shared token) -> the arbiter's client


# --- the synthetic node ----------------------------------------------------------------------------------


def node_inventory(spec: NodeSpec) -> Inventory:
    """An inventory of `spec.gpus` GPUs of `spec.gpu_model`, NVLinked as `spec.nvlink_domains` says (a GPU
    listed in no domain is a domain of its own), as discovery would report it. It depends on the node's shape
    only, so nodes alike share one (and the allocator's per-inventory caches)."""
    return _shaped_inventory(spec.gpus, spec.gpu_model or "GPU", spec.nvlink_domains)


@functools.lru_cache(maxsize=256)
def _shaped_inventory(count: int, model: str, nvlink_domains: tuple[tuple[int, ...], ...]) -> Inventory:
    bus = [f"{i >> 8:04x}:{i & 0xFF:02x}:00.0" for i in range(count)]
    peers: dict[int, tuple[str, ...]] = {}
    for domain in nvlink_domains:
        for i in domain:
            peers[i] = tuple(bus[j] for j in domain if j != i)
    gpus = [
        Gpu(
            index=i,
            minor=i,
            uuid=f"GPU-{i:08x}-0000-0000-0000-000000000000",
            product_name=model,
            brand="Nvidia",
            architecture="",
            cuda_compute_capability="",
            memory_bytes=0,
            pci_bus_id=bus[i],
            pci_device_id=0,
            nvlink_peers=peers.get(i, ()),
        )
        for i in range(count)
    ]
    stamped, domains = assign_nvlink_domains(gpus)
    return Inventory(driver_version="", cuda_driver_version="", gpus=stamped, nvlink_domains=domains)


@dataclass(frozen=True)
class Holding:
    """What one pod holds on a node: GPU indices, milli-GPUs on each, and its reservation ("" for a pod that was
    running before the simulation, whose devices count as allocated)."""

    gpus: tuple[int, ...]
    milli: int
    reservation: str = ""


class SimulatedNode:
    """One snapshot node as its agent sees it: an inventory, what pods hold, and the reservation service."""

    def __init__(
        self, spec: NodeSpec, allocator: Allocator, clock: Clock, token: str, new_id: Callable[[], str]
    ) -> None:
        self.spec = spec
        self.inventory = node_inventory(spec)
        self.index_of = {gpu_device_name(g.minor): g.index for g in self.inventory.gpus}  # device name -> index
        self.holdings: dict[str, Holding] = {}  # pod -> what it holds
        self.unhealthy: set[int] = set()  # GPUs the node's allocator must not give out (the arbiter cannot know)
        self._usage: NodeUsage | None = None
        self.book = ReservationBook(lambda: self.inventory, self.usage, allocator, clock, new_id)
        self.service = NodeAllocatorService(self.book, token)

    def usage(self) -> NodeUsage:
        """Devices taken outside the book: pods running before the simulation, unhealthy GPUs."""
        if self._usage is None:
            whole: set[str] = set()
            shared: dict[str, int] = {}
            for h in self.holdings.values():
                if h.reservation:
                    continue  # the book counts it
                for g in h.gpus:
                    if h.milli >= MILLI:
                        whole.add(gpu_device_name(g))
                    else:
                        shared[gpu_device_name(g)] = shared.get(gpu_device_name(g), 0) + h.milli
            unhealthy = frozenset(gpu_device_name(g) for g in self.unhealthy)
            self._usage = NodeUsage(allocated=frozenset(whole), unhealthy=unhealthy, shared_milli=shared)
        return self._usage

    def mark_unhealthy(self, index: int) -> None:
        self.unhealthy.add(index)
        self._usage = None

    def hold(self, pod: str, holding: Holding) -> None:
        self.holdings[pod] = holding
        if not holding.reservation:
            self._usage = None

    def drop(self, pod: str) -> Holding:
        holding = self.holdings.pop(pod)
        if not holding.reservation:
            self._usage = None
        return holding

    def index_map(self, seats: Mapping[str, Holding]) -> dict[int, int]:
        """The arbiter's GPU index -> this node's, given where the arbiter seats the pods holding devices here
        (`seats`): each pod's GPUs onto the ones it really holds, free GPUs onto free ones (themselves first)."""
        mapping: dict[int, int] = {}
        for pod, seat in seats.items():
            held = self.holdings.get(pod)
            if held is not None:
                mapping.update(zip(sorted(seat.gpus), sorted(held.gpus), strict=False))
        taken = set(mapping.values())
        free_here = [g for g in range(self.spec.gpus) if g not in taken]
        unmapped = [g for g in range(self.spec.gpus) if g not in mapping]
        both = set(free_here) & set(unmapped)
        mapping.update((g, g) for g in both)
        mapping.update(
            zip((g for g in unmapped if g not in both), (g for g in free_here if g not in both), strict=False)
        )
        return mapping


# --- pinning requests to the arbiter's GPUs ----------------------------------------------------------------


def index_selector(indices: Iterable[int]) -> str:
    """A DRA CEL selector for the GPUs with these indices."""
    return f'device.attributes["{DRIVER}"].index in [{", ".join(str(i) for i in sorted(indices))}]'


class PinningSelectors:
    """CEL selectors, with the ones `index_selector` writes answered without running CEL (same meaning, far
    cheaper: the simulator pins every request it commits)."""

    def __init__(self, fallback: CelSelectors | None = None) -> None:
        self._fallback = fallback or CelSelectors()
        self._pins: dict[str, frozenset[int]] = {}

    def pin(self, indices: Iterable[int]) -> str:
        pinned = frozenset(indices)  # read once: `indices` may be an iterator
        expression = index_selector(pinned)
        self._pins.setdefault(expression, pinned)
        return expression

    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        pinned = self._pins.get(expression)
        if pinned is None:
            return self._fallback.matches(expression, device)
        index = device["attributes"].get(DRIVER, {}).get("index")
        return index in pinned


def member_claim(pod: PodSpec, pin: tuple[int, ...] | None, selectors: PinningSelectors) -> Claim:
    """What a pod asks its node for: `gpus` whole GPUs, or a fraction of one; pinned to `pin` when given."""
    pinned = (selectors.pin(pin),) if pin is not None else ()
    if pod.fractional:
        return Claim((DeviceRequest("gpu", selectors=pinned, gpu_milli=pod.gpu_milli),))
    return Claim((DeviceRequest("gpus", selectors=pinned, count=pod.gpu_milli // MILLI),))


# --- the commit step --------------------------------------------------------------------------------------


@dataclass
class CommitStats:
    committed: int = 0  # gangs whose every member was reserved and confirmed
    released: int = 0  # reservations freed because their pod stopped running
    refused: int = 0  # gangs a node refused: their pods went back to pending
    relocated: int = 0  # gangs the nodes could not seat on the GPUs the arbiter named (placed on others)
    refused_pods: dict[str, str] = field(default_factory=dict)  # pod -> why, for the last round
    seconds: list[float] = field(default_factory=list)  # per round


def _holding_at_start(d: PodDecision) -> bool:
    """The pod held devices when the round began (running or releasing; evicted this round)."""
    return d.node is not None and d.action in ("keep", "evict")


def _milli(pod: PodSpec) -> int:
    """Milli-GPUs the pod holds on each of its GPUs."""
    return pod.gpu_milli if pod.fractional else MILLI


class ReservationCommit:
    """`simulate`'s commit hook: call it with each round's CycleResult; it returns the decisions as they turned
    out. One SimulatedNode per snapshot node, built when a gang first binds there; one token shared by the
    arbiter and every node (`connect` builds the arbiter's client to a node: tests give it a wrong token)."""

    def __init__(
        self,
        nodes: Sequence[NodeSpec],
        clock: Clock,
        token: str,
        *,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        new_id: Callable[[], str] | None = None,
        connect: Connect = InProcessClient,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be positive, got {ttl_seconds}")
        self._specs = {n.name: n for n in nodes}
        self._clock = clock
        self._token = token
        self._ttl = ttl_seconds
        counter = itertools.count(1)
        self._new_id = new_id or (lambda: f"r{next(counter)}")
        self._connect = connect
        self.selectors = PinningSelectors()
        self._allocator = Allocator(self.selectors)  # the nodes' own default device choice
        self.nodes: dict[str, SimulatedNode] = {}
        self._clients: dict[str, NodeClient] = {}
        self._coordinator = GangCoordinator(self._clients)
        self._round = 0
        self.stats = CommitStats()

    def node(self, name: str) -> SimulatedNode:
        """The simulated node `name`, built on first use (its pods' holdings are adopted by the next round)."""
        built = self.nodes.get(name)
        if built is None:
            built = self.nodes[name] = SimulatedNode(
                self._specs[name], self._allocator, self._clock, self._token, self._new_id
            )
            self._clients[name] = self._connect(built.service, self._token)
        return built

    def __call__(self, result: CycleResult) -> CycleResult:
        start = self._clock()
        self._round += 1
        self.stats.refused_pods = {}
        specs = {p.name: p for j in result.before.jobs for p in j.pods}
        pods = dict(result.pods)
        gangs: dict[str, list[str]] = {}
        for job in result.before.jobs:
            bound = [p.name for p in job.pods if pods[p.name].action == "bind"]
            if bound:
                gangs[job.name] = bound
        touched = {pods[p].node for bound in gangs.values() for p in bound if specs[p].gpu_milli > 0}
        maps = self._sync({n for n in touched if n is not None}, pods, specs)
        for job_name, bound in gangs.items():
            self._commit_gang(job_name, bound, pods, specs, maps)
        self._release_stopped(pods)
        self.stats.seconds.append(self._clock() - start)
        return dataclasses.replace(result, pods=pods)

    def _sync(
        self, touched: set[str], pods: Mapping[str, PodDecision], specs: Mapping[str, PodSpec]
    ) -> dict[str, dict[int, int]]:
        """Build the touched nodes (adopting pods running there) and map the arbiter's GPU indices to theirs."""
        seats: dict[str, dict[str, Holding]] = {n: {} for n in touched}
        for name, d in pods.items():
            if d.node in seats and _holding_at_start(d) and specs[name].gpu_milli > 0:
                seats[d.node][name] = Holding(d.gpus, _milli(specs[name]))
        maps = {}
        for name, here in seats.items():
            node = self.node(name)
            for pod, seat in here.items():
                if pod not in node.holdings:
                    node.hold(pod, seat)  # running before the simulation: held where the arbiter seats it
            maps[name] = node.index_map(here)
        return maps

    def _commit_gang(
        self,
        job: str,
        bound: list[str],
        pods: dict[str, PodDecision],
        specs: Mapping[str, PodSpec],
        maps: Mapping[str, Mapping[int, int]],
    ) -> None:
        members = [p for p in bound if specs[p].gpu_milli > 0]
        if not members:
            return  # CPU-only pods reserve nothing
        gang_id = f"{job}#{self._round}"

        def placements(pinned: bool) -> list[MemberPlacement]:
            out = []
            for p in members:
                d = pods[p]
                assert d.node is not None
                pin = tuple(maps[d.node].get(g, g) for g in d.gpus) if pinned else None
                out.append(MemberPlacement(p, d.node, member_claim(specs[p], pin, self.selectors)))
            return out

        outcome = self._coordinator.place(gang_id, placements(pinned=True), self._ttl)
        if not outcome.committed:
            retry = self._coordinator.place(gang_id, placements(pinned=False), self._ttl)
            if retry.committed:
                self.stats.relocated += 1
                outcome = retry
        if not outcome.committed:
            self.stats.refused += 1
            for p in bound:
                pods[p] = PodDecision("pending", None, "keep")
                self.stats.refused_pods[p] = outcome.reason
            return
        self.stats.committed += 1
        for p, (node_name, r) in outcome.reservations.items():
            node = self.nodes[node_name]
            gpus = tuple(sorted(node.index_of[dev] for dev in r.fit.all_devices))
            spec = specs[p]
            node.hold(p, Holding(gpus, _milli(spec), r.id))
            d = pods[p]
            if gpus != d.gpus:
                pods[p] = dataclasses.replace(d, gpus=gpus, gpu_index=gpus[0] if spec.fractional else None)

    def _release_stopped(self, pods: Mapping[str, PodDecision]) -> None:
        """A pod that will not be running next round gives its devices back (its reservation released)."""
        for name, node in self.nodes.items():
            stopped = [p for p in node.holdings if pods[p].outcome != "running"]
            for p in stopped:
                holding = node.drop(p)
                if holding.reservation:
                    self._clients[name].release(reservation_id=holding.reservation)
                    self.stats.released += 1
