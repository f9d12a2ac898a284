"""The arbiter as a running controller: informers in, one cycle at a time, decisions out through the API.

Each cycle: wait until the informers show the previous cycle's writes; build the snapshot from them
(agent.arbiter.world); finish or undo any commit a previous cycle or leader left half done; run the core
(fair shares, allocate, consolidate, reclaim, preempt); evict victims through the Eviction API (the pod's
grace period applies; the core spares victims inside their queue's min-runtime); commit each gang the core
bound (agent.arbiter.commit); say with Events why gangs wait; write Queue status; record metrics.

A cycle runs when an informer shows a change or a commit lands. With nothing changed it would decide what the
last one did, so the run loop waits until something falls due: the clock's next say in the decisions (a
protection or a preemption delay ending: agent.arbiter.core.due), a retry, or `resync_s`. An idle arbiter then
costs nothing per period, however large the cluster.

The arbiter is the only allocator of its driver's devices: it keeps the DeviceTaintRule of agent.arbiter.fence
in place (kube-scheduler allocates no tainted device) and commits only once that rule has been in force for
`fence_settle_s`, so an allocation kube-scheduler decided before it saw the rule is in the API first. A
device found in two claims anyway (written by hand, or before the fence) is counted once and reported.

Nothing lives only in memory: every decision is re-derived from the API each cycle, so a restarted or newly
elected arbiter continues where the last one stopped. Claims are written for gated pods, which kube-scheduler
does not look at, and for ungated pods whose claims no one could allocate (behind the fence, kube-scheduler
cannot); once a pod is ungated it is the scheduler's, with its claims allocated, reserved for it and valid on
exactly the node its affinity (or the claims' nodeSelector) names.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from agent.allocation.allocator import Claim
from agent.allocation.capacity import CapacitySummary
from agent.arbiter.commit import Committer, InvalidClaim, Outcome, Write
from agent.arbiter.core.cycle import DEFAULT_ACTIONS, CycleResult
from agent.arbiter.core.due import next_due
from agent.arbiter.core.incremental import CycleCache
from agent.arbiter.core.model import Fairness, Placement, Snapshot, Vector
from agent.arbiter.core.usage import Accumulator
from agent.arbiter.fence import default_queue, fence_rule, fences
from agent.arbiter.metrics import ArbiterMetrics, cycle_values
from agent.arbiter.queue_status import STRANDED, queue_statuses, stranded_reasons
from agent.arbiter.queue_usage import PERSIST_EVERY_S, capacity, from_status, held, shown, to_status
from agent.arbiter.waiting import wait_reasons
from agent.arbiter.world import Gang, Member, World, WorldCache, build_world
from agent.kube.errors import ApiError, NotFound
from agent.kube.events import EventRecorder
from agent.kube.informer import Informer, start_all
from agent.kube.rest import (
    DEVICE_CLASSES,
    DEVICE_TAINT_RULES,
    NODES,
    POD_GROUPS,
    PODS,
    QUEUES,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Rest,
)
from agent.names import DEFAULT_QUEUE, FENCE_RULE, FINGERPRINT_ANNOTATION
from agent.objects.read import ShareDevices, meta
from agent.reservation.protocol import NodeClient, NodeUnavailable, Reservation
from agent.reservation.transport import GrpcNodeClient, pinned_channel
from agent.times import parse_rfc3339, rfc3339

log = logging.getLogger(__name__)
WAIT_REFRESH_S = 30.0  # a wait reason whose numbers changed is told again at most this often
# time-aware fair share with nothing changed: cycled again once a hundredth of the usage's half-life has passed,
# when past usage has moved by under 0.7 % (a cycle at every look would cost a whole cycle a period)
USAGE_STEP = 0.01
# the apiVersion of each kind the snapshot may leave out (a Pod's is v1)
_API_VERSIONS = {
    "Queue": QUEUES.api_version,
    "PodGroup": POD_GROUPS.api_version,
    "ResourceClaim": RESOURCE_CLAIMS.api_version,
}


@dataclass(frozen=True)
class ArbiterConfig:
    driver: str = "gpu.nvidia.com"
    ttl_seconds: float = 30.0  # how long a node holds a reservation the arbiter has not confirmed
    # how often the run loop looks when no change was seen: it cycles only once something falls due (the clock's
    # next say in the decisions, a retry, work under way), or `resync_s` after the last cycle
    period_s: float = 1.0
    # a cycle at least this often (on the monotonic clock), whatever changed: a safety net, as an informer's
    # resync; 0: a cycle at every look
    resync_s: float = 60.0
    # a cycle starts at least this long after the previous one started: under churn (pods ending, claims freed,
    # gangs arriving) the changes of a burst are decided in one cycle, not in one cycle each
    cycle_gap_s: float = 1.0  # KAI's schedulePeriod
    actions: tuple[str, ...] = DEFAULT_ACTIONS
    sync_timeout_s: float = 60.0
    expectation_timeout_s: float = 5.0  # how long a cycle waits for the informers to show our last writes
    # an informer that has read every event so far waits this long before reading on: the events of that time
    # then cost one wake-up, not one each (0.1 s halved the informers' CPU per pod in the bench). The watches
    # then trail each other by up to this much; a gang of ours bound before its claims show allocated still
    # holds its GPUs (world._group_gangs)
    watch_linger_s: float = 0.1
    commit_workers: int = 32  # gangs committed at once (each is all-or-nothing on its own; writes wait on the API)
    status_period_s: float = 1.0  # Queue status is written at most this often
    # time-aware fair share: past usage decays with this half-life (seconds); None: plain fair share
    usage_half_life_s: float | None = None
    k_value: float = 1.0  # how strongly past usage shifts the over-quota division (KAI's kValue)
    placement: Placement = field(default_factory=Placement)  # node choice: GPUs by fgd unless told otherwise
    default_queue: str | None = DEFAULT_QUEUE  # where gated pods naming no queue wait; None: they are not ours
    # commit only once the fence has been in force this long: kube-scheduler's allocations decided before it
    # saw the rule are written by then (its binding cycle writes the claim right after deciding)
    fence_settle_s: float = 2.0
    # an admitted pod kube-scheduler has refused to bind this long is reported (a shorter refusal is a gang's
    # pods being ungated one by one, or informers catching up)
    unbindable_after_s: float = 30.0


@dataclass
class _Took:
    """How long a timed block took (wall seconds), once it has ended."""

    seconds: float = 0.0


@dataclass
class CycleReport:
    """What one cycle did (for tests, logs and the benchmark)."""

    admitted: list[str] = field(default_factory=list)  # gangs committed
    refused: dict[str, str] = field(default_factory=dict)  # gang -> why its commit failed
    evicted: list[str] = field(default_factory=list)
    recovered: list[str] = field(default_factory=list)
    waiting: dict[str, str] = field(default_factory=dict)
    result: CycleResult | None = None


@dataclass
class _Flight:
    """A gang whose commit is under way, and where its members go."""

    outcome: futures.Future[Outcome]
    members: list[tuple[Member, str]]


@dataclass
class _Landed:
    """A gang committed whose writes the informers do not all show yet: until they do (or `deadline`), it
    counts as placed where it went, as while under way, and the cycle need not wait for those writes."""

    members: list[tuple[Member, str]]
    writes: list[Write]
    deadline: float  # monotonic


class PinnedClient:
    """A NodeClient that connects on its first call (a node no commit uses costs no handshake)."""

    def __init__(self, directory: NodeDirectory, node: str, address: str, fingerprint: str) -> None:
        self._directory = directory
        self._target = (node, address, fingerprint)

    def _connect(self) -> GrpcNodeClient:
        return self._directory.client(*self._target)

    def _writing(self) -> GrpcNodeClient:
        """The client for a call that changes what the node holds: only while the API writes may go on."""
        self._directory.check_writes()
        return self._connect()

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        try:
            return self._writing().reserve(gang_id, member, claim, ttl_seconds)
        except NodeUnavailable as e:
            cause = e.__cause__
            if isinstance(cause, grpc.Call) and cause.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidClaim(cause.details() or str(e)) from e  # the claim's error, not the node's
            raise

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        return self._writing().reserve_many(gang_id, members, ttl_seconds)  # names an invalid claim: MemberInvalid

    def confirm(self, reservation_id: str) -> Reservation:
        return self._writing().confirm(reservation_id)

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        return self._writing().confirm_many(reservation_ids)

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        return self._writing().release(reservation_id, gang_id)

    def capacity(self) -> CapacitySummary:
        return self._connect().capacity()


class _NodeClients(Mapping[str, NodeClient]):
    """Every addressed node's client, each made when asked for: a commit asks for its gang's nodes alone, and making
    them all (a fingerprint read from the Node informer each) cost more than a gang's own calls did."""

    def __init__(self, directory: NodeDirectory, addresses: Mapping[str, str]) -> None:
        self._directory, self._addresses = directory, addresses

    def __getitem__(self, node: str) -> NodeClient:
        address = self._addresses[node]
        return PinnedClient(self._directory, node, address, self._directory.fingerprint(node))

    def __iter__(self) -> Iterator[str]:
        return iter(self._addresses)

    def __len__(self) -> int:
        return len(self._addresses)


class NodeDirectory:
    """gRPC clients to the nodes' reservation APIs over TLS, one channel per advertised address and published
    certificate fingerprint (`fingerprint(node)`, from the Node's annotation): a restarted agent has a new
    certificate and gets a new channel. A node whose server shows another certificate gets none (its calls
    raise CertificateMismatch, a NodeUnavailable), and no token is sent to it. `write_gate`: the API client's
    (Rest.write_gate), consulted before every Reserve, Confirm and Release too."""

    def __init__(
        self,
        token: str | Callable[[], str],
        timeout_s: float = 5.0,
        fingerprint: Callable[[str], str] = lambda node: "",
        write_gate: Callable[[], None] | None = None,
    ) -> None:
        self._token = token
        self._write_gate = write_gate
        self._timeout = timeout_s
        self.fingerprint = fingerprint  # node -> the certificate fingerprint its Node publishes
        self._channels: dict[tuple[str, str, str], grpc.Channel] = {}
        self._clients: dict[tuple[str, str, str], GrpcNodeClient] = {}
        self._lock = threading.Lock()  # commit workers connect at once
        self.addresses: Mapping[str, str] = {}

    def check_writes(self) -> None:
        """Raises NodeUnavailable when the write gate refuses (the call then fails as an unreachable node's)."""
        if self._write_gate is not None:
            try:
                self._write_gate()
            except ApiError as e:
                raise NodeUnavailable(e.reason) from e

    def clients(self) -> Mapping[str, NodeClient]:
        return _NodeClients(self, self.addresses)

    def client(self, node: str, address: str, fingerprint: str) -> GrpcNodeClient:
        """The client over the channel for this node, address and fingerprint, connecting first if needed."""
        key = (node, address, fingerprint)
        with self._lock:
            client = self._clients.get(key)
        if client is None:
            channel = pinned_channel(address, fingerprint, node, self._timeout)
            with self._lock:
                for old in [k for k in self._channels if k[0] == node and k != key]:  # a restarted agent's
                    self._channels.pop(old).close()
                    self._clients.pop(old, None)
                if key in self._channels:  # another worker connected first
                    channel.close()
                else:
                    self._channels[key] = channel
                    # one client per channel: its stub's method objects cost more to make than a call
                    self._clients[key] = GrpcNodeClient(channel, self._token, self._timeout)
                client = self._clients[key]
        return client

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self._clients.clear()


class Arbiter:
    def __init__(
        self,
        rest: Rest,
        token: str | Callable[[], str],
        config: ArbiterConfig = ArbiterConfig(),
        *,
        metrics: ArbiterMetrics | None = None,
        recorder: EventRecorder | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._rest = rest
        self._clock = clock
        self.metrics = metrics
        self._recorder = recorder
        self._changed = threading.Event()

        def wake() -> None:
            # set() takes a lock and notifies on every event; the informer stored the change before this check,
            # and the loop clears the flag before it reads the informers, so a skipped set loses nothing
            if not self._changed.is_set():
                self._changed.set()

        watch = functools.partial(Informer, rest, on_change=wake, linger_s=config.watch_linger_s)
        self.pods = watch(PODS)
        self.claims = watch(RESOURCE_CLAIMS)
        self.pod_groups = watch(POD_GROUPS, optional=True)
        self.queues = watch(QUEUES, optional=True)
        self.nodes = watch(NODES)
        self.slices = watch(RESOURCE_SLICES)
        self.classes = watch(DEVICE_CLASSES)
        self.taint_rules = watch(DEVICE_TAINT_RULES, optional=True)  # served from 1.37
        self._informers = [
            self.pods,
            self.claims,
            self.pod_groups,
            self.queues,
            self.nodes,
            self.slices,
            self.classes,
            self.taint_rules,
        ]
        self._by_resource = {inf.resource: inf for inf in self._informers}  # where a write shows (_seen)
        # one write gate for the API and the nodes alike (a leader's Lease check: agent.kube.leader)
        self.directory = NodeDirectory(
            token, fingerprint=self._fingerprint, write_gate=getattr(rest, "write_gate", None)
        )  # tests may pass no Rest
        self._committer = Committer(
            rest, config.driver, self.directory.clients, ttl_seconds=config.ttl_seconds, clock=clock
        )
        self._expected: list[Write] = []
        self._weighed: dict[str, float] = {}  # waiting job -> when a snapshot first had it waiting (World.weighed)
        self._world_cache = WorldCache()  # what the last snapshot read from objects unchanged since
        self._cycle_cache = CycleCache()  # the last cycle's session: the next one starts from it where it can
        self._flights: dict[str, _Flight] = {}  # gang -> its commit under way (pipelined cycles)
        self._landed: dict[str, _Landed] = {}  # gang -> committed, its writes not all seen yet
        self._pool = futures.ThreadPoolExecutor(max(1, config.commit_workers), thread_name_prefix="commit")
        # Queue status is written by one thread of its own, in order: the cycle does not wait for those writes
        self._status_writer = futures.ThreadPoolExecutor(1, thread_name_prefix="queue-status")
        self._terminating: dict[str, str] = {}  # pod key -> uid: evicted, not yet seen terminating
        self._waits: dict[str, tuple[str, float]] = {}  # gang -> the wait reason last told, and when
        self._told: dict[str, str] = {}  # object left out of the snapshot -> the reason last told
        # claim key -> (uid, resourceVersion, the node's words): a claim a node refused as written waits, told
        # once, until it changes (a new resourceVersion, or a new claim of that name)
        self._refused_claims: dict[str, tuple[str, str, str]] = {}
        self._queue_status: dict[str, Any] = {}
        self._status_written = -math.inf
        self._status_held = False  # a cycle's Queue status not written: the last write was too recent
        self._usage: dict[str, Accumulator] = {}  # per queue, advanced every cycle
        self._usage_state: dict[str, dict[str, Any]] = {}  # per queue, as last persisted in its status
        self._fence_served = True  # the API serves DeviceTaintRules (1.37+); checked at start
        self._fenced_since: float | None = None  # when the fence rule came into force (epoch seconds)
        self._fence_tried = -math.inf
        self._queue_tried = -math.inf
        self.doubles: dict[tuple[str, str], list[str]] = {}  # devices in two claims, as last seen
        self.unbindable: dict[str, str] = {}  # admitted pods kube-scheduler refuses -> its message, as last told
        self.cycles = 0
        self.unchanged_cycles = 0  # cycles the run loop started with no change seen since the last one
        self.skipped_looks = 0  # looks of the run loop that found no change and nothing due: no cycle
        self._due = -math.inf  # when the run loop cycles with no change seen (_next_due); -inf: at its next look
        self._resync_at = math.inf  # monotonic: when the run loop cycles whatever it sees (resync_s after one)
        self._again = False  # something this cycle did failed and is tried again: the next look cycles
        self.evictions: dict[str, int] = {}  # cause -> pods evicted through the Eviction API since start
        self.timings: dict[str, float] = {}  # seconds spent per phase, over all cycles (logs, the benchmark)
        self.cpu_timings: dict[str, float] = {}  # CPU seconds of the cycle's own thread per phase (wall time
        # above includes waiting for the interpreter while informer and commit threads hold it)

    # -- running ------------------------------------------------------------------------------------------

    def start(self) -> None:
        start_all(self._informers, self.config.sync_timeout_s)
        try:
            self._rest.list(DEVICE_TAINT_RULES)
        except NotFound:
            self._fence_served = False
            log.warning(
                "this API server serves no DeviceTaintRules (resource.k8s.io/v1, Kubernetes 1.37): "
                "nothing keeps kube-scheduler off %s devices; gate every pod that uses them",
                self.config.driver,
            )
        except ApiError as e:
            log.warning("cannot list DeviceTaintRules: %s", e)
        self._keep_fence(self._clock())

    def flush_events(self, timeout: float = 10.0) -> bool:
        """Wait until the Events recorded so far are written (they are written in the background)."""
        return self._recorder.flush(timeout) if self._recorder is not None else True

    def commit_timings(self) -> dict[str, float]:
        """Seconds per commit step (reserve, write claims, confirm, ungate, and the I/O threads' writes as steps of
        their own), summed over parallel commits."""
        return dict(self._committer.timings)

    def commit_cpu_timings(self) -> dict[str, float]:
        """CPU seconds per commit step: the commits' own threads' and, as steps of their own, the I/O threads'."""
        return dict(self._committer.cpu_timings)

    def stop(self) -> None:
        for inf in self._informers:
            inf.stop()
        self._pool.shutdown(wait=True)
        self._status_writer.shutdown(wait=True)
        self._committer.close()
        self.directory.close()

    def run(self, stop: threading.Event) -> None:
        started = -math.inf
        while not stop.is_set():
            changed = self._changed.wait(self.config.period_s)
            if stop.wait(started + self.config.cycle_gap_s - time.monotonic()):
                return
            if not (changed or self._changed.is_set()):
                # the resync on the monotonic clock: a wall clock set back cannot hold off cycles for longer
                if self._clock() < self._due and time.monotonic() < self._resync_at:
                    self.skipped_looks += 1  # nothing it reads changed, nothing fell due: the cycle would repeat
                    continue
                self.unchanged_cycles += 1  # woken by the period alone: only the clock moved
            self._changed.clear()
            started = time.monotonic()
            self._resync_at = started + self.config.resync_s
            try:
                self.cycle(pipelined=True)
            except Exception:  # one bad cycle must not stop the arbiter: the next one starts from the API
                log.exception("arbiter cycle failed")

    def _fingerprint(self, node: str) -> str:
        """The certificate fingerprint the node's agent published on its Node ("" when none)."""
        obj = self.nodes.get("", node) or {}
        return str((meta(obj).get("annotations") or {}).get(FINGERPRINT_ANNOTATION) or "")

    # -- one cycle ------------------------------------------------------------------------------------------

    def cycle(self, *, pipelined: bool = False) -> CycleReport:
        """One cycle. Pipelined (the run loop), it does not wait for its gangs' commits: the next cycle starts
        while they are under way, counting them as placed, and reports those that have landed; otherwise it
        returns once they have."""
        report = CycleReport()
        self._due, self._again = -math.inf, False  # a cycle that raises or returns early is followed by another
        self._land(report, wait=False)
        with self._timed("wait for informers"):
            self._await_expectations()
        now = self._clock()
        with self._timed("snapshot"):
            unseen = self._unseen()
            world = self._world(now, unseen)
        self._weighed = world.weighed
        self.directory.addresses = world.addresses
        self._keep_default_queue(now)
        self._tell_invalid(world)
        self._report_doubles(world)
        self._report_unbindable(world, now)
        with self._timed("release"):
            for pod in world.release:
                with contextlib.suppress(ApiError):
                    self._expected.append(self._committer.release_gate(pod))
        with self._timed("recover"):  # a gang under way (or landed, not yet seen so) is not half done
            writes, completed = self._committer.recover(g for g in world.gangs.values() if g.name not in unseen)
        if writes:
            report.recovered = completed
            self._expected.extend(writes)
            self._changed.set()  # decide on the repaired state next
            return report
        snapshot = replace(world.snapshot, placement=self.config.placement)
        if self.config.usage_half_life_s is not None:
            snapshot = self._with_usage(snapshot, now)
        with self._timed("decide") as decided:
            result = self._cycle_cache.run(snapshot, self.config.actions)
        report.result = result
        self.cycles += 1
        with self._timed("evict"):
            self._evict(world, result, report)
        if self._fence_settled(now):  # else the next cycle (at most `period_s` away) decides again
            with self._timed("commit"):
                self._commit(world, result)
                if not pipelined:
                    self._land(report, wait=True)
        with self._timed("events and status"):
            report.waiting = {**world.waiting, **wait_reasons(snapshot, result, world.unserved)}
            self._tell_waiting(world, report.waiting, now)
            self._write_queue_status(snapshot, result, now, world)
        if self.metrics is not None:
            self.metrics.record(cycle_values(result, now, decided.seconds))
        self._due = self._next_due(now, snapshot, world)
        return report

    def _next_due(self, now: float, snapshot: Snapshot, world: World) -> float:
        """When the next cycle is due if nothing the arbiter reads changes meanwhile (math.inf: never; the run
        loop still cycles `resync_s` after the last cycle): the clock's next say in the decisions (core.due),
        time-aware usage's drift, a deferred Queue status, an unbindable pod's report, the fence's settling.
        Anything in motion or to be tried again keeps the period's pace: commits under way, writes and evictions
        not yet seen, a failed eviction, a missing fence rule or default Queue."""
        in_motion = self._flights or self._landed or self._expected or self._terminating
        queue = self.config.default_queue
        if (
            in_motion
            or self._again
            or (queue and self.queues.get("", queue) is None)
            or (self._fence_served and self._fenced_since is None)
        ):
            return now
        moments = [next_due(snapshot)]
        if self.config.usage_half_life_s is not None:
            moments.append(now + max(self.config.period_s, self.config.usage_half_life_s * USAGE_STEP))
        if self._fenced_since is not None:  # served and in force (else returned above)
            moments.append(self._fenced_since + self.config.fence_settle_s)
        if self._status_held:
            moments.append(self._status_written + self.config.status_period_s)
        moments += [u.since + self.config.unbindable_after_s for u in world.unbindable.values() if u.since is not None]
        return min((at for at in moments if at > now), default=math.inf)  # those past have had their cycle

    @contextlib.contextmanager
    def _timed(self, phase: str) -> Iterator[_Took]:
        """Adds the block's wall time and the cycle thread's CPU to the phase's totals; `.seconds` after it."""
        took = _Took()
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield took
        finally:
            took.seconds = time.perf_counter() - start
            self.timings[phase] = self.timings.get(phase, 0.0) + took.seconds
            self.cpu_timings[phase] = self.cpu_timings.get(phase, 0.0) + time.thread_time() - cpu

    def _world(self, now: float, unseen: Mapping[str, list[tuple[Member, str]]]) -> World:
        in_flight = {m.key: node for members in unseen.values() for m, node in members}
        return build_world(
            pods=self.pods.items(),
            claims=self.claims.items(),
            pod_groups=self.pod_groups.items(),
            queues=self.queues.items(),
            nodes=self.nodes.items(),
            slices=self.slices.items(),
            driver=self.config.driver,
            now=now,
            default_queue=self.config.default_queue,
            in_flight=in_flight,
            weighed=self._weighed,
            refused_claims=self._still_refused(),
            cache=self._world_cache,
        )

    # -- the fence ----------------------------------------------------------------------------------------

    def _keep_default_queue(self, now: float) -> None:
        """Create the default Queue when it is missing (pods that name no queue wait in it)."""
        name = self.config.default_queue
        if not name or self.queues.get("", name) is not None or now - self._queue_tried < 5.0:
            return
        self._queue_tried = now
        try:
            self._rest.create(QUEUES, None, default_queue(name))
            log.info("created the default Queue %s (pods that name no queue wait in it)", name)
        except ApiError as e:
            if e.status != 409:  # created meanwhile: fine
                log.warning("cannot create the default Queue %s: %s", name, e)

    def _keep_fence(self, now: float) -> None:
        """Create (or restore) the DeviceTaintRule that keeps other allocators off the driver's devices, and
        note since when it is in force: its creation when it was never changed, else when we first saw it."""
        rule = self.taint_rules.get("", FENCE_RULE)
        if fences(rule, self.config.driver):
            if self._fenced_since is None:
                m = meta(rule or {})
                born = parse_rfc3339(m.get("creationTimestamp")) if int(m.get("generation") or 1) == 1 else None
                self._fenced_since = born if born is not None else now
            return
        self._fenced_since = None
        if not self._fence_served or now - self._fence_tried < 5.0:
            return
        self._fence_tried = now
        body = fence_rule(self.config.driver)
        try:
            if rule is None:
                written = self._rest.create(DEVICE_TAINT_RULES, None, body)
            else:  # ours by name, changed by someone: put our selector and taint back
                written = self._rest.replace(DEVICE_TAINT_RULES, {**rule, "spec": body["spec"]})
            log.info(
                "device taint rule %s in place: only the arbiter allocates %s devices", FENCE_RULE, self.config.driver
            )
            self._expected.append((DEVICE_TAINT_RULES, "", FENCE_RULE, str(meta(written).get("resourceVersion"))))
        except ApiError as e:
            log.warning(
                "cannot put the device taint rule %s in place (kube-scheduler may allocate %s devices "
                "beside the arbiter): %s",
                FENCE_RULE,
                self.config.driver,
                e,
            )

    def _fence_settled(self, now: float) -> bool:
        """Whether commits may go ahead: the fence has been in force for fence_settle_s. Where the API serves
        no DeviceTaintRules (before 1.37) there is no fence to wait for: a warning was logged at start."""
        self._keep_fence(now)
        if not self._fence_served:
            return True
        return self._fenced_since is not None and now - self._fenced_since >= self.config.fence_settle_s

    def _report_doubles(self, world: World) -> None:
        """A device in two claims never stops a cycle (it counts as used once); say so, once per device and
        set of claims: a Warning Event on each claim, the metric, the log."""
        for device, keys in world.doubles.items():
            if self.doubles.get(device) == keys:
                continue
            log.warning("device %s/%s is allocated to %d claims at once: %s", *device, len(keys), ", ".join(keys))
            for key in keys:
                ns, _, name = key.partition("/")
                claim = self.claims.get(ns, name)
                if claim is not None:
                    others = ", ".join(k for k in keys if k != key)
                    self._event(
                        claim,
                        "ResourceClaim",
                        RESOURCE_CLAIMS.api_version,
                        "DeviceInTwoClaims",
                        f"device {device[1]} of pool {device[0]} is also allocated to {others}; the arbiter "
                        "counts it as used and places nothing else on it",
                        type_="Warning",
                    )
        self.doubles = dict(world.doubles)
        if self.metrics is not None:
            self.metrics.double_allocated.set(len(world.doubles))

    def _report_unbindable(self, world: World, now: float) -> None:
        """Admitted pods kube-scheduler will not bind where the arbiter placed them, for a rule the arbiter does not
        read (pod affinity, topology spread, host ports, volumes): say so once per refusal, in kube-scheduler's
        words (a Warning Event on the pod, the log, the metric). Their claims stay allocated, as the pod may only
        go to that node; removing the pod is its owner's call."""
        lasting = {
            key: u
            for key, u in world.unbindable.items()
            if u.since is None or now - u.since >= self.config.unbindable_after_s
        }
        for key, stuck in lasting.items():
            if self.unbindable.get(key) == stuck.message:
                continue
            member = world.members[key]
            log.warning(
                "kube-scheduler does not bind %s to %s, where the arbiter admitted it: %s",
                key,
                stuck.node,
                stuck.message,
            )
            self._event(
                member.pod,
                "Pod",
                "v1",
                "Unbindable",
                f"kube-scheduler does not bind this pod to {stuck.node}, where the arbiter admitted it and "
                f"its claims are allocated: {stuck.message}",
                type_="Warning",
            )
        self.unbindable = {key: u.message for key, u in lasting.items()}
        if self.metrics is not None:
            self.metrics.unbindable.set(len(lasting))

    def _await_expectations(self) -> None:
        """Until the informers show what we wrote (or deleted): a decision on an older copy could commit a
        gang twice or evict more victims than needed."""
        deadline = time.monotonic() + self.config.expectation_timeout_s
        while self._expected or self._terminating:
            self._expected = [w for w in self._expected if not self._seen(w)]
            self._terminating = {k: uid for k, uid in self._terminating.items() if not self._terminates(k, uid)}
            if not (self._expected or self._terminating):
                return
            if time.monotonic() > deadline:
                log.warning(
                    "informers did not show %d writes in time; deciding anyway",
                    len(self._expected) + len(self._terminating),
                )
                self._expected.clear()
                self._terminating.clear()
                return
            time.sleep(0.005)

    def _seen(self, write: Write) -> bool:
        """Whether the informer of the written resource shows the write (or a later version, or none)."""
        return _seen(self._by_resource[write[0]], write)

    def _terminates(self, key: str, uid: str) -> bool:
        ns, _, name = key.partition("/")
        pod = self.pods.get(ns, name)
        return pod is None or meta(pod).get("uid") != uid or bool(meta(pod).get("deletionTimestamp"))

    # -- decisions out ----------------------------------------------------------------------------------------

    def _evict(self, world: World, result: CycleResult, report: CycleReport) -> None:
        gang_of: dict[str, Gang] = {}  # pod key -> its gang, built at the first eviction
        for name, decision in result.pods.items():
            if decision.action != "evict" or decision.cause is None:
                continue
            member = world.members.get(name)
            if member is None:
                continue
            m = meta(member.pod)
            try:
                self._rest.evict(str(m.get("namespace")), str(m.get("name")), str(m.get("uid")))
            except NotFound:
                continue
            except ApiError as e:  # e.g. a PodDisruptionBudget says not now: the next cycle decides again
                log.warning("evicting %s failed: %s", name, e)
                self._again = True
                continue
            report.evicted.append(name)
            self.evictions[decision.cause] = self.evictions.get(decision.cause, 0) + 1
            self._terminating[name] = str(m.get("uid"))
            if not gang_of:
                gang_of = {key: g for g in world.gangs.values() for key in g.members}
            victim = gang_of.get(name)
            gang, queue = decision.evicted_for or ("a waiting gang", "its queue")
            what = "moved to node " + decision.moved_to if decision.moved_to else "evicted"
            self._event(
                member.pod,
                "Pod",
                "v1",
                "Evicted",
                f"{what} by the arbiter ({decision.cause}) to make room for gang {gang} of queue {queue}",
                type_="Warning",
            )
            log.info(
                "evicted %s (gang %s, queue %s) on node %s: %s for gang %s of queue %s",
                name,
                victim.name if victim else "?",
                victim.queue if victim else "?",
                member.node or decision.node,
                decision.cause,
                gang,
                queue,
            )

    def _commit(self, world: World, result: CycleResult) -> None:
        """Start the commit of each gang the cycle bound, each on a worker of its own."""
        bound: dict[str, list[tuple[str, str]]] = {}
        for spec in result.before.jobs:
            for pod in spec.pods:
                d = result.pods[pod.name]
                if d.action == "bind" and d.node is not None:
                    bound.setdefault(spec.name, []).append((pod.name, d.node))
        classes = {str(meta(c).get("name")): c for c in self.classes.items()}
        for job, pods in bound.items():
            if job in self._flights:
                continue  # cannot happen (a gang under way counts as running), but never commit one twice
            gang, members = world.gangs[job], [(world.members[name], node) for name, node in pods]
            outcome = self._pool.submit(self._commit_gang, gang, members, classes, world.shareable, result.before.now)
            self._flights[job] = _Flight(outcome, members)

    def _commit_gang(
        self,
        gang: Gang,
        members: list[tuple[Member, str]],
        classes: Mapping[str, Mapping[str, Any]],
        shareable: ShareDevices,
        decided_at: float | None = None,
    ) -> Outcome:
        """One gang's commit, told as soon as it has landed (a worker's)."""
        # the gang id is the job's name: stable across arbiters, so a successor can release what it left
        group = self.pod_groups.get(gang.namespace, gang.pod_group) if gang.pod_group else None
        outcome = self._committer.commit(gang.name, members, classes, shareable, group, decided_at=decided_at)
        if outcome.committed:
            placed = ", ".join(f"{meta(m.pod).get('name')} on {node}" for m, node in members)
            log.info(
                "admitted gang %s of queue %s on nodes %s",
                gang.name,
                gang.queue,
                ",".join(sorted({node for _, node in members})),
            )
            # one Event per gang: on its PodGroup, or on the pod of a gang of one (kube-scheduler writes one
            # per pod; an Event per member as well would cost more writes than the admission itself)
            if not self._tell(gang.pod_group, gang.namespace, gang.name, "Admitted", f"admitted: {placed}"):
                for m, node in members:
                    self._event(m.pod, "Pod", "v1", "Admitted", f"admitted by the arbiter to node {node}")
        elif outcome.refused is None:  # a refused claim is told on the claim, and why its pods wait (_land)
            log.info("gang %s not committed: %s", gang.name, outcome.reason)
            self._tell_gang(gang, "NotAdmitted", outcome.reason, type_="Warning")
        self._changed.set()  # the next cycle takes in what it wrote
        return outcome

    def _land(self, report: CycleReport, *, wait: bool) -> None:
        """The commits that have finished (all of them, waiting, with `wait`): their writes are what the next
        snapshot must show."""
        for job, flight in list(self._flights.items()):
            if not (wait or flight.outcome.done()):
                continue
            del self._flights[job]
            # a commit that raised fails this cycle, as any error does: the next one starts from the API (and
            # recovers what the commit left half done); the others that landed are taken in then
            outcome = flight.outcome.result()
            if outcome.committed:
                report.admitted.append(job)
                deadline = time.monotonic() + self.config.expectation_timeout_s
                self._landed[job] = _Landed(flight.members, list(outcome.writes), deadline)
            else:  # rolled back: the next decision waits until the informers show its claims free again
                report.refused[job] = outcome.reason
                if outcome.refused is not None:
                    self._refuse_claim(*outcome.refused)
                self._expected.extend(outcome.writes)

    def _refuse_claim(self, claim: Mapping[str, Any], message: str) -> None:
        """Remember a claim a node refused as written, and say so once, on the claim (its pods are told why
        they wait by the next cycle). It is not tried again until it changes."""
        m = meta(claim)
        key = f"{m.get('namespace')}/{m.get('name')}"
        self._refused_claims[key] = (str(m.get("uid")), str(m.get("resourceVersion")), message)
        log.warning("ResourceClaim %s refused by a node, not tried again until it changes: %s", key, message)
        self._event(
            claim,
            "ResourceClaim",
            RESOURCE_CLAIMS.api_version,
            "InvalidClaim",
            f"a node refused this claim as written: {message}; the arbiter tries it again once the claim changes",
            type_="Warning",
        )

    def _still_refused(self) -> dict[str, str]:
        """The refused claims not changed since (claim key -> the node's words); changed or gone, forgotten."""
        for key, (uid, version, _) in list(self._refused_claims.items()):
            ns, _, name = key.partition("/")
            m = meta(self.claims.get(ns, name) or {})
            if (str(m.get("uid")), str(m.get("resourceVersion"))) != (uid, version):
                del self._refused_claims[key]
        return {key: message for key, (_, _, message) in self._refused_claims.items()}

    def _unseen(self) -> dict[str, list[tuple[Member, str]]]:
        """The gangs placed by us that the informers do not show placed yet (under way, or landed and not seen),
        and where their members go."""
        now = time.monotonic()
        for job, landed in list(self._landed.items()):
            landed.writes = [w for w in landed.writes if not self._seen(w)]
            if not landed.writes:
                del self._landed[job]
            elif now > landed.deadline:
                log.warning("informers did not show the commit of %s in time; deciding on what they show", job)
                del self._landed[job]
        return {
            **{job: f.members for job, f in self._flights.items()},
            **{job: g.members for job, g in self._landed.items()},
        }

    def _tell_waiting(self, world: World, waiting: Mapping[str, str], now: float) -> None:
        """Why each gang waits, as an Event on what it is about: the PodGroup, or the pod of a gang of one. A
        reason is told again when it changes; when only its numbers change, at most every WAIT_REFRESH_S: they
        change every cycle, and an Event per gang per cycle would cost more writes than the admissions."""
        self._waits = {job: told for job, told in self._waits.items() if job in waiting}  # admitted or gone
        for job, reason in waiting.items():
            gang = world.gangs.get(job)
            if gang is None:
                continue
            told = self._waits.get(job)
            if told is not None and (
                told[0] == reason
                or (told[0].split(":", 1)[0] == reason.split(":", 1)[0] and now - told[1] < WAIT_REFRESH_S)
            ):
                continue
            self._waits[job] = (reason, now)
            type_ = "Normal" if reason.startswith("waiting for") else "Warning"  # progress, not a problem
            self._tell_gang(gang, "Waiting", reason, type_=type_)

    def _tell_gang(self, gang: Gang, reason: str, message: str, *, type_: str) -> None:
        """An Event about a gang, on what it is: its PodGroup, or the pod of a gang of one."""
        if gang.pod_group is not None:
            self._tell(gang.pod_group, gang.namespace, gang.name, reason, message, type_=type_)
            return
        for m in gang.members.values():
            if m.node is None:
                self._event(m.pod, "Pod", "v1", reason, message, type_=type_)

    def _tell(
        self, pod_group: str | None, namespace: str, job: str, reason: str, message: str, *, type_: str = "Normal"
    ) -> bool:
        """An Event on the gang's PodGroup; False when it has none (the caller tells the pods)."""
        if pod_group is None:
            return False
        group = self.pod_groups.get(namespace, pod_group)
        if group is None:
            return False
        self._event(group, "PodGroup", POD_GROUPS.api_version, reason, message, type_=type_)
        return True

    def _event(
        self, obj: Mapping[str, Any], kind: str, api_version: str, reason: str, message: str, *, type_: str = "Normal"
    ) -> None:
        if self._recorder is not None:
            self._recorder.record(obj, kind, api_version, reason, message, type_=type_)

    def _with_usage(self, snapshot: Snapshot, now: float) -> Snapshot:
        """Fold the time since the last cycle into every queue's decayed usage (resumed from its status after
        a restart) and hand the normalised usage to the fair-share division."""
        holding, total = held(snapshot), capacity(snapshot)
        usage: dict[str, Vector] = {}
        for q in snapshot.queues:
            acc = self._usage.get(q.name)
            if acc is None:
                acc = from_status((self.queues.get("", q.name) or {}).get("status"))
            acc = acc.advance(now, holding.get(q.name, (0.0, 0.0, 0.0)), total, self.config.usage_half_life_s)
            self._usage[q.name] = acc
            usage[q.name] = acc.usage
        return replace(snapshot, fairness=Fairness(usage=usage, k_value=self.config.k_value))

    def _tell_invalid(self, world: World) -> None:
        """A Warning Event (and a log line) on each object left out of the snapshot, once per reason."""
        told = {k: v for k, v in self._told.items() if k in world.invalid}
        for key, bad in world.invalid.items():
            if told.get(key) == bad.reason:
                continue
            told[key] = bad.reason
            log.warning("%s left out of the arbiter's snapshot: %s", key, bad.reason)
            self._event(bad.obj, bad.kind, _API_VERSIONS.get(bad.kind, "v1"), "Invalid", bad.reason, type_="Warning")
        self._told = told

    def _write_queue_status(self, snapshot: Snapshot, result: CycleResult, now: float, world: World) -> None:
        # at most once a second, as KAI's queue controller does it periodically: a busy cycle changes every
        # queue's numbers, and a status write per queue per cycle would compete with the admissions
        if 0 <= now - self._status_written < self.config.status_period_s:
            self._status_held = True  # written by a cycle once the period is over (_next_due)
            return
        self._status_written, self._status_held = now, False
        statuses: dict[str, dict[str, Any]] = {
            name: {**status, "conditions": [self._valid_condition(name, None, now)]}
            for name, status in queue_statuses(snapshot, result).items()
        }
        for key, bad in world.invalid.items():
            if bad.kind == "Queue":
                name = key.removeprefix("Queue ")
                statuses[name] = {"conditions": [self._valid_condition(name, bad.reason, now)]}
        for name, (reason, message) in stranded_reasons(snapshot, world.stranded).items():
            if name in statuses:
                stranded = self._condition(name, STRANDED, "True", now, reason=reason, message=message)
                statuses[name] = {**statuses[name], "conditions": [*statuses[name]["conditions"], stranded]}
        for name, acc in self._usage.items():
            if name not in statuses:
                continue
            kept = self._usage_state.get(name)
            if kept is None or now - _updated_at(kept) >= PERSIST_EVERY_S:
                kept = self._usage_state[name] = to_status(acc)
            statuses[name] = {**statuses[name], "usage": shown(acc), "usageState": kept}
        changed = {name: status for name, status in statuses.items() if self._queue_status.get(name) != status}
        if changed:
            self._status_writer.submit(self._patch_queue_status, changed)

    def _patch_queue_status(self, statuses: Mapping[str, dict[str, Any]]) -> None:
        for name, status in statuses.items():
            try:
                self._rest.patch(QUEUES, None, name, {"status": status}, subresource="status")
                self._queue_status[name] = status
            except ApiError as e:
                log.debug("queue %s status not written: %s", name, e)
                self._changed.set()  # written again by the next cycle, which this wakes

    def _valid_condition(self, name: str, problem: str | None, now: float) -> dict[str, str]:
        """The Queue's `Valid` condition."""
        return self._condition(
            name,
            "Valid",
            "False" if problem else "True",
            now,
            reason="InvalidSpec" if problem else "Accepted",
            message=problem or "the arbiter weighs this queue",
        )

    def _condition(self, name: str, kind: str, status: str, now: float, *, reason: str, message: str) -> dict[str, str]:
        """A condition of the Queue; its lastTransitionTime moves only when its status does."""
        since = rfc3339(now)
        current = ((self.queues.get("", name) or {}).get("status") or {}).get("conditions") or ()
        for c in current:
            if isinstance(c, dict) and c.get("type") == kind and c.get("status") == status:
                since = str(c.get("lastTransitionTime") or since)
        return {"type": kind, "status": status, "reason": reason, "message": message, "lastTransitionTime": since}


def _updated_at(state: Mapping[str, Any]) -> float:
    return from_status({"usageState": state}).at or 0.0


def _seen(inf: Informer, write: Write) -> bool:
    _, ns, name, version = write
    obj = inf.get(ns, name)
    if obj is None:
        return True  # deleted meanwhile: nothing more to wait for
    have = str(meta(obj).get("resourceVersion") or "")
    if have == version:
        return True
    try:
        return int(have) > int(version)
    except ValueError:
        return False


__all__ = ["Arbiter", "ArbiterConfig", "CycleReport", "NodeDirectory"]
