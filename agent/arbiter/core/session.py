"""One cycle's mutable state: the cluster, queue allocations, jobs and pods, with undoable statements.

Every change goes through `bind`, `pipeline`, `evict`, `move` or `restore` and is logged, so an action can try a
scenario (a gang, a set of victims) and `rollback` to a checkpoint if it does not work out: no partial gang and
no needless eviction ever survives. Queue allocation counts what pods will hold once pending releases finish
(running, bound, pipelined), which is what fair share and limits are judged on.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import Literal

from agent.arbiter.core.cluster import Cluster, Node, Seat
from agent.arbiter.core.fairshare import fair_shares
from agent.arbiter.core.model import MILLI, UNLIMITED, JobSpec, PodSpec, QueueSpec, Snapshot, Vector
from agent.arbiter.core.snapshot import SnapshotError

EPS = 1e-6
_NAME = attrgetter("name")
_TASK_ORDER = attrgetter("task_priority", "gpu_milli")
State = Literal["running", "pending", "releasing", "bound", "pipelined", "evicted"]
Cause = Literal["reclaim", "preempt", "consolidate"]
OpKind = Literal["bind", "pipeline", "evict", "move", "restore", "demote"]


class Queue:
    __slots__ = (
        "alloc",
        "alloc_np",
        "allocatable",
        "children",
        "fair",
        "heap",
        "index",
        "limit",
        "parent",
        "path",
        "priority",
        "quota",
        "quota_raw",
        "ranked",
        "ranked_valid",
        "spec",
    )

    def __init__(self, spec: QueueSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.priority = spec.priority
        self.parent: Queue | None = None
        self.children: list[Queue] = []
        self.path: tuple[Queue, ...] = ()  # self, parent, ..., top-level queue
        self.alloc = [0.0, 0.0, 0.0]
        self.alloc_np = [0.0, 0.0, 0.0]  # held by non-preemptible jobs
        self.fair: Vector = (0.0, 0.0, 0.0)
        self.quota_raw = tuple(t.quota for t in spec.terms)
        self.quota: Vector = (0.0, 0.0, 0.0)  # -1 resolved to the level total
        self.limit = tuple(math.inf if t.limit == UNLIMITED else t.limit for t in spec.terms)
        # KAI's allocatable share: max(quota, fair share) capped by the limit (an unlimited quota: the limit, or
        # the cluster when there is none). The denominator of the dominant share; set with the fair shares.
        self.allocatable: Vector = (0.0, 0.0, 0.0)
        self.heap: list[_Entry] = []
        # JobOrder's cache: the subtree's best waiting job, ranked as this queue, while `ranked_valid`
        self.ranked: Ranked | None = None
        self.ranked_valid = False


# a waiting job in its leaf's heap: the job key (its fields; the job index makes it unique), the job, and the
# request its queue is ranked with
_Entry = tuple[int, int, float, int, "Job", Vector]


class Job:
    __slots__ = (
        "_chunk",
        "_chunk_active",
        "_chunk_request",
        "_least_gpu",
        "_pending",
        "active",
        "gained",
        "index",
        "pods",
        "preemptible",
        "queue",
        "running",
        "spec",
        "total",
    )

    def __init__(self, spec: JobSpec, index: int, queue: Queue) -> None:
        self.spec = spec
        self.index = index
        self.queue = queue
        self.preemptible = spec.preemptible
        self.pods: list[Pod] = []  # by task priority, highest first
        self.active = 0  # pods running, bound or pipelined (counted toward minMember)
        self.running = 0  # pods running and not evicted: what a victim still has to give
        self.gained = 0  # pods bound or pipelined this cycle: such a job is no victim in the same cycle
        self.total: Vector = (0.0, 0.0, 0.0)  # what all its pods ask for: its queue's demand
        # caches, dropped whenever a pod leaves or re-enters pending (see `Session`); the chunk also depends on
        # `active`, so it is kept with the value it was computed for (-1: none)
        self._pending: list[Pod] | None = None
        self._least_gpu = -1  # the least GPU a pending pod asks for (-1: not known)
        self._chunk: list[Pod] | None = None
        self._chunk_request: Vector = (0.0, 0.0, 0.0)
        self._chunk_active = -1

    def key(self) -> tuple[int, int, float, int]:
        """Job order inside a leaf: priority, then gangs below minMember before at-min before elastic growth,
        then older first."""
        at = (self.active > self.spec.min_member) - (self.active < self.spec.min_member) + 1
        return (-self.spec.priority, at, self.spec.created_at, self.index)

    def pending(self) -> list[Pod]:
        """The pods still waiting, in task order (shared: do not modify)."""
        if self._pending is None:
            self._pending = [p for p in self.pods if p.state == "pending"]
        return self._pending

    def least_pending_gpu(self) -> int:
        """The least GPU any pending pod asks for, in milli-GPUs (0 with none pending). Kept across cycles of a
        reused session, where most jobs' pending pods do not change."""
        if self._least_gpu < 0:
            self._least_gpu = min((p.spec.gpu_milli for p in self.pending()), default=0)
        return self._least_gpu

    def chunk(self) -> list[Pod] | None:
        """The pods to place next: the missing part of the gang, or one pod of elastic growth."""
        if self._chunk_active != self.active:
            self._next()
        return self._chunk

    def chunk_request(self) -> Vector:
        """What the next chunk asks for in all (zero when there is no chunk)."""
        if self._chunk_active != self.active:
            self._next()
        return self._chunk_request

    def pending_changed(self) -> None:
        self._pending = None
        self._least_gpu = -1
        self._chunk_active = -1

    def _next(self) -> None:
        pending = self.pending()
        chunk: list[Pod] | None = None
        if pending:
            if self.active >= self.spec.min_member:
                chunk = pending[:1]
            else:
                missing = self.spec.min_member - self.active
                chunk = pending[:missing] if len(pending) >= missing else None
        self._chunk = chunk
        self._chunk_request = request_of(chunk or ())
        self._chunk_active = self.active


class Pod:
    __slots__ = ("cause", "evicted_for", "job", "moved_to", "req", "seat", "shape", "spec", "state", "was")

    def __init__(self, spec: PodSpec, job: Job) -> None:
        self.spec = spec
        self.req = spec.request
        # what decides where the pod fits, whoever asks: pods of one shape fit or fail alike
        other = tuple(sorted(spec.other.items())) if spec.other else ()
        self.shape = (spec.gpu_milli, spec.cpu_milli, spec.mem_bytes, spec.allowed_nodes, other)
        self.job = job
        self.state: State = "pending"
        self.was: State = "pending"  # state at the start of the cycle
        self.seat: Seat | None = None
        self.moved_to: Seat | None = None
        self.cause: Cause | None = None
        self.evicted_for: Job | None = None  # the gang its eviction makes room for (the Event names it)


class _Op:
    """One logged statement, undone by `Session.rollback` (a plain class: see `Seat`)."""

    __slots__ = ("cause", "kind", "pod", "seat")

    def __init__(self, kind: OpKind, pod: Pod, seat: Seat, cause: Cause | None = None) -> None:
        self.kind = kind
        self.pod = pod
        self.seat = seat
        self.cause = cause  # restore: the eviction's cause, back if the restore is undone


class Session:
    def __init__(self, snapshot: Snapshot) -> None:
        workload = (p.gpu_milli for j in snapshot.jobs for p in j.pods)
        self.cluster = Cluster(snapshot.nodes, snapshot.placement, workload)
        self.queues = [Queue(q, i) for i, q in enumerate(snapshot.queues)]
        by_name = {q.spec.name: q for q in self.queues}
        for q in self.queues:
            q.parent = by_name[q.spec.parent] if q.spec.parent is not None else None
        for q in self.queues:
            path: list[Queue] = []
            cur: Queue | None = q
            while cur is not None:
                path.append(cur)
                cur = cur.parent
            q.path = tuple(path)
        self.tops: list[Queue] = []  # the top-level queues
        for q in self.queues:
            (q.parent.children if q.parent is not None else self.tops).append(q)
        self.by_name = by_name
        self.jobs = [self.new_job(j, i) for i, j in enumerate(snapshot.jobs)]
        self.pods: list[Pod] = []
        self.node_pods: list[list[Pod]] = [[] for _ in self.cluster.nodes]
        for job in self.jobs:
            self.pods.extend(job.pods)
        self.now = snapshot.now
        self.log: list[_Op] = []
        self.dirty: set[Queue] = set()  # queues whose allocation changed: JobOrder re-ranks them
        # reclaim/preempt victims of the scenarios taken so far and still evicted, per node, in units (lists of
        # pods) keyed by eviction order: a later scenario that frees more than it needs may restore them (evict.py)
        self.victims: dict[int, list[tuple[tuple[int, int], list[Pod]]]] = {}
        self._rest_nodes: list[tuple[float, float, float, float, dict[str, float], dict[str, float]]] = []
        self._rest_queues: list[tuple[list[float], list[float]]] = []
        self._load_placed()
        self.compute_fair_shares(snapshot)

    # -- setup ------------------------------------------------------------------------------------------

    def new_job(self, spec: JobSpec, index: int) -> Job:
        """A job of the snapshot with its pods, all pending until `_load_placed` seats the placed ones."""
        job = Job(spec, index, self.by_name[spec.queue])
        # task priority, then size, both descending; then name (two stable sorts, no per-pod key tuple; the
        # second only where the pods differ, as a gang's usually do not)
        specs = sorted(spec.pods, key=_NAME)
        first = specs[0] if specs else None
        if first is not None and any(
            p.task_priority != first.task_priority or p.gpu_milli != first.gpu_milli for p in specs
        ):
            specs.sort(key=_TASK_ORDER, reverse=True)
        job.pods = [Pod(p, job) for p in specs]
        job.total = request_of(job.pods)
        return job

    def _load_placed(self) -> None:
        placed = [p for p in self.pods if p.spec.node is not None]
        releasing = self._seat_placed(placed, any(shares_gpu(p.spec) for p in placed))
        self.cluster.index()
        for n in releasing:
            self.cluster.mark_release(n, 1)

    def reload(self, nodes: Sequence[int], placed: list[Pod], sort: bool) -> None:
        """Seat again the pods placed on `nodes` (`placed`: all of them, in session order), as a session built
        whole would (`sort`: whether any pod of the snapshot placed anywhere shares a GPU): the pods there before
        are taken off, each node emptied, then `placed` loaded in the order `_load_placed` loads them."""
        cluster = self.cluster
        for n in nodes:
            for pod in self.node_pods[n]:
                if pod.state == "running":
                    pod.job.running -= 1
                    self._account(pod, -1)
                pod.seat, pod.state, pod.was = None, "pending", "pending"
            self.node_pods[n] = []
            cluster.empty(cluster.nodes[n])
        releasing = self._seat_placed(placed, sort)
        for n in nodes:
            cluster.index_node(cluster.nodes[n])
        for n in releasing:
            cluster.mark_release(n, 1)

    def _seat_placed(self, placed: list[Pod], sort: bool) -> list[int]:
        """Load the placed pods into the layers; the nodes of those releasing, one entry each."""
        # fractional pods with a known GPU first, so whole-GPU pods take the devices nobody shares (a stable sort,
        # needed only where some pod shares a GPU)
        if sort:
            placed.sort(key=lambda p: (p.spec.gpu_index is None, p.spec.fractional))
        held: dict[tuple[int, int], list[int]] = {}  # (job, node) -> GPUs the job's pods hold there
        cluster = self.cluster
        nodes, by_name = cluster.nodes, cluster.by_name
        releasing: list[int] = []
        for pod in placed:
            node = nodes[by_name[pod.spec.node or ""]]
            running = pod.spec.status == "Running"
            where = (pod.job.index, node.index)
            seat = self._initial_seat(pod, node, held.get(where, ()))
            if seat is None:
                raise SnapshotError(
                    f"pod {pod.spec.name!r} does not fit on node {node.spec.name!r} beside the other pods placed there."
                )
            cluster.load(pod.spec, seat, running)
            pod.seat = seat
            pod.state = pod.was = "running" if running else "releasing"
            if running:
                pod.job.running += 1
                self._account(pod, 1)
            else:
                releasing.append(seat.node)
            self.node_pods[seat.node].append(pod)
            held.setdefault(where, []).extend(seat.gpus)
        return releasing

    @staticmethod
    def _initial_seat(pod: Pod, node: Node, held: Sequence[int]) -> Seat | None:
        spec = pod.spec
        if node.cpu_now < spec.cpu_milli - EPS or node.mem_now < spec.mem_bytes - EPS:
            return None
        if spec.gpu_milli == 0:
            return Seat(node.index, ())
        if spec.fractional:
            options = [spec.gpu_index] if spec.gpu_index is not None else range(node.spec.gpus)
            fitting = [g for g in options if node.gpu_now[g] + spec.gpu_milli <= MILLI]
            if not fitting:
                return None
            return Seat(node.index, (max(fitting, key=lambda g: (node.gpu_now[g], -g)),))
        count = spec.gpu_milli // MILLI
        used = node.gpu_now
        free = [g for g in range(node.spec.gpus) if used[g] == 0]
        if len(free) < count:
            return None
        domains = node.domains
        if held and len(domains) > 1:  # the domains that already hold some of the gang first, in order
            ours = [d for d in domains if any(g in held for g in d)]
            domains = ours + [d for d in domains if d not in ours]
        for domain in domains:
            fitting = [g for g in domain if used[g] == 0]
            if len(fitting) >= count:
                return Seat(node.index, tuple(fitting[:count]))
        return Seat(node.index, tuple(free[:count]))

    def compute_fair_shares(self, snapshot: Snapshot) -> None:
        demand: dict[str, Vector] = {}
        for job in self.jobs:
            total = job.total
            prev = demand.get(job.queue.spec.name, (0.0, 0.0, 0.0))
            demand[job.queue.spec.name] = (prev[0] + total[0], prev[1] + total[1], prev[2] + total[2])
        nodes = snapshot.nodes
        capacity: Vector = (
            float(sum(n.gpus for n in nodes) * MILLI),
            float(sum(n.cpu_milli for n in nodes)),
            float(sum(n.mem_bytes for n in nodes)),
        )
        self.capacity = capacity
        fairness = snapshot.fairness
        shares = fair_shares(snapshot.queues, demand, capacity, fairness.usage, fairness.k_value)
        for q in self.queues:
            q.fair = shares[q.spec.name]
            level = capacity if q.parent is None else q.parent.fair
            quota = [level[r] if raw == UNLIMITED else raw for r, raw in enumerate(q.quota_raw)]
            q.quota = (quota[0], quota[1], quota[2])
            allocatable = [0.0, 0.0, 0.0]
            for r, raw in enumerate(q.quota_raw):
                if raw == UNLIMITED:
                    allocatable[r] = q.limit[r] if q.limit[r] != math.inf else capacity[r]
                else:
                    allocatable[r] = min(q.limit[r], max(raw, q.fair[r]))
            q.allocatable = (allocatable[0], allocatable[1], allocatable[2])

    # -- the state before any action --------------------------------------------------------------------

    def mark_rest(self) -> None:
        """Remember what rolling back would restore only by arithmetic (CPU, memory and other resources per
        node, allocations per queue: floats that may not come back to the last bit), so `reset` can return the
        session to its state before any action exactly."""
        self._rest_nodes = [
            (n.cpu_now, n.cpu_after, n.mem_now, n.mem_after, dict(n.other_now), dict(n.other_after))
            for n in self.cluster.nodes
        ]
        self._rest_queues = [(list(q.alloc), list(q.alloc_np)) for q in self.queues]

    def reset(self) -> None:
        """Back to the state `mark_rest` saw: every statement undone, those quantities put back as they were."""
        for op in self.log:
            op.pod.evicted_for = None
        self.rollback(0)
        for node, (cpu_now, cpu_after, mem_now, mem_after, other_now, other_after) in zip(
            self.cluster.nodes, self._rest_nodes, strict=True
        ):
            node.cpu_now, node.cpu_after, node.mem_now, node.mem_after = cpu_now, cpu_after, mem_now, mem_after
            if other_now or node.other_now:
                node.other_now = dict(other_now)
            if other_after or node.other_after:
                node.other_after = dict(other_after)
        for q, (alloc, alloc_np) in zip(self.queues, self._rest_queues, strict=True):
            q.alloc[:] = alloc
            q.alloc_np[:] = alloc_np
        self.victims = {}
        self.dirty.clear()

    # -- protections ------------------------------------------------------------------------------------

    def may_evict_for(self, job: Job) -> bool:
        """A pending job within its preemption delay evicts no one (KAI v0.17): it waits for capacity."""
        if not job.spec.preemption_delay or self.now is None:
            return True
        since = job.spec.pending_since if job.spec.pending_since is not None else job.spec.created_at
        return self.now >= since + job.spec.preemption_delay

    @staticmethod
    def preempt_min_runtime(queue: Queue) -> float:
        """The victim queue's preemptMinRuntime, inherited from the nearest ancestor that sets one."""
        for q in queue.path:
            if q.spec.preempt_min_runtime is not None:
                return q.spec.preempt_min_runtime
        return 0.0

    @staticmethod
    def reclaim_min_runtime(reclaimer: Queue, victim: Queue) -> float:
        """KAI's "lca" resolution: the victim side's reclaimMinRuntime, looked up from the victim's queue just
        below the lowest common ancestor upward (minruntime/resolver.go resolveReclaimMinRuntimeLCA)."""
        ours = set(reclaimer.path)
        below = [q for q in victim.path if q not in ours]  # victim side, leaf first
        start = victim.path.index(below[-1]) if below else 0
        for q in victim.path[start:]:
            if q.spec.reclaim_min_runtime is not None:
                return q.spec.reclaim_min_runtime
        return 0.0

    # -- checks -----------------------------------------------------------------------------------------

    def admissible(self, job: Job, req: Sequence[float]) -> bool:
        """Limits hold at every ancestor; a non-preemptible job stays within quota at every ancestor."""
        return self.within_limits(job, req) and self.within_np_quota(job, req)

    @staticmethod
    def within_limits(job: Job, req: Sequence[float]) -> bool:
        """The queue and every ancestor stay within their limits with `req` added (KAI max_allowed_check)."""
        for q in job.queue.path:
            for r in range(3):
                if req[r] and q.alloc[r] + req[r] > q.limit[r] + EPS:
                    return False
        return True

    @staticmethod
    def limits_hold(job: Job) -> bool:
        """The job's queue and its ancestors are within their limits as things stand."""
        return all(q.alloc[r] <= q.limit[r] + EPS for q in job.queue.path for r in range(3))

    @staticmethod
    def within_np_quota(job: Job, req: Sequence[float]) -> bool:
        """A non-preemptible job keeps the non-preemptible allocation within quota at every ancestor (KAI
        quota_check: such jobs are never victims, so they may only hold what is guaranteed)."""
        if job.preemptible:
            return True
        for q in job.queue.path:
            for r in range(3):
                if req[r] and q.quota_raw[r] != UNLIMITED and q.alloc_np[r] + req[r] > q.quota_raw[r] + EPS:
                    return False
        return True

    # -- statements -------------------------------------------------------------------------------------

    def checkpoint(self) -> int:
        return len(self.log)

    def rollback(self, mark: int) -> None:
        while len(self.log) > mark:
            self._undo(self.log.pop())

    def bind(self, pod: Pod, seat: Seat) -> None:
        self.cluster.occupy(pod.spec, seat, now=True, after=True, sign=1)
        self._enter(pod, seat, "bound")

    def pipeline(self, pod: Pod, seat: Seat) -> None:
        self.cluster.occupy(pod.spec, seat, now=False, after=True, sign=1)
        self._enter(pod, seat, "pipelined")

    def demote(self, pod: Pod) -> None:
        """A bound pod of a gang whose other members must wait for releases waits with them."""
        assert pod.seat is not None
        self.cluster.occupy(pod.spec, pod.seat, now=True, after=False, sign=-1)
        pod.state = "pipelined"
        self.log.append(_Op("demote", pod, pod.seat))

    def evict(self, pod: Pod, cause: Cause, for_job: Job | None = None) -> None:
        assert pod.seat is not None and pod.state == "running"
        pod.evicted_for = for_job
        self.cluster.occupy(pod.spec, pod.seat, now=False, after=True, sign=-1)
        self.cluster.mark_release(pod.seat.node, 1)
        pod.state, pod.cause = "evicted", cause
        pod.job.running -= 1
        self._account(pod, -1)
        self.log.append(_Op("evict", pod, pod.seat))

    def restore(self, pod: Pod) -> None:
        """Take back an eviction the scenario turned out not to need."""
        assert pod.seat is not None and pod.state == "evicted"
        self.cluster.occupy(pod.spec, pod.seat, now=False, after=True, sign=1)
        self.cluster.mark_release(pod.seat.node, -1)
        cause, pod.state, pod.cause = pod.cause, "running", None
        pod.job.running += 1
        self._account(pod, 1)
        self.log.append(_Op("restore", pod, pod.seat, cause))

    def move(self, pod: Pod, seat: Seat) -> None:
        """An evicted pod is promised a new seat (consolidation): it keeps its job whole."""
        self.cluster.occupy(pod.spec, seat, now=False, after=True, sign=1)
        pod.moved_to = seat
        self._account(pod, 1)
        self.log.append(_Op("move", pod, seat))

    def _enter(self, pod: Pod, seat: Seat, state: State) -> None:
        pod.seat, pod.state = seat, state
        pod.job.pending_changed()
        pod.job.gained += 1
        self._account(pod, 1)
        self.log.append(_Op("bind" if state == "bound" else "pipeline", pod, seat))

    def _undo(self, op: _Op) -> None:
        kind, pod, seat, cause = op.kind, op.pod, op.seat, op.cause
        occupy = self.cluster.occupy
        if kind == "evict":
            occupy(pod.spec, seat, now=False, after=True, sign=1)
            self.cluster.mark_release(seat.node, -1)
            pod.state, pod.cause = "running", None
            pod.job.running += 1
            self._account(pod, 1)
        elif kind in ("bind", "pipeline"):
            occupy(pod.spec, seat, now=kind == "bind", after=True, sign=-1)
            pod.seat, pod.state = None, "pending"
            pod.job.pending_changed()
            pod.job.gained -= 1
            self._account(pod, -1)
        elif kind == "demote":
            occupy(pod.spec, seat, now=True, after=False, sign=1)
            pod.state = "bound"
        elif kind == "restore":
            occupy(pod.spec, seat, now=False, after=True, sign=-1)
            self.cluster.mark_release(seat.node, 1)
            pod.state, pod.cause = "evicted", cause
            pod.job.running -= 1
            self._account(pod, -1)
        else:  # move
            occupy(pod.spec, seat, now=False, after=True, sign=-1)
            pod.moved_to = None
            self._account(pod, -1)

    def _account(self, pod: Pod, sign: int) -> None:
        """A pod starts (1) or stops (-1) counting toward its job's members and its queues' allocation."""
        job = pod.job
        job.active += sign
        gpu, cpu, mem = pod.req
        if sign < 0:
            gpu, cpu, mem = -gpu, -cpu, -mem
        path = job.queue.path
        for q in path:
            alloc = q.alloc
            alloc[0] += gpu
            alloc[1] += cpu
            alloc[2] += mem
        if not job.preemptible:
            for q in path:
                alloc = q.alloc_np
                alloc[0] += gpu
                alloc[1] += cpu
                alloc[2] += mem
        self.dirty.update(path)


def shares_gpu(pod: PodSpec) -> bool:
    """A placed pod that may share its GPU: placed pods are loaded in an order that seats these first."""
    return pod.fractional or pod.gpu_index is not None


def request_of(pods: Iterable[Pod]) -> Vector:
    gpu = cpu = mem = 0.0
    for p in pods:
        req = p.req
        gpu += req[0]
        cpu += req[1]
        mem += req[2]
    return (gpu, cpu, mem)


class QueueRank:
    """A queue's place in queue order, KAI's (queue_order.go GetQueueOrderResult), with its tie-breaks in KAI's
    order: over-served queues (above fair share in every resource) last; a job that keeps its queue within quota
    first; higher priority; a queue that would use a resource it has no allocatable share of last; smaller
    dominant share of the allocatable share with the job, then without it; the weaker allocatable share (no
    larger in every resource and smaller in one: a partial order, so two shares neither weaker tie); the older
    queue. A class with plain fields rather than a tuple: a compiled core compares it in C, and a cycle ranks
    queues at every pop of every action."""

    __slots__ = ("allocatable", "index", "outside", "over", "penalised", "priority", "with_job", "without_job")

    def __init__(self, q: Queue, req: Vector) -> None:
        """`q`'s rank with a job asking `req`."""
        alloc, fair, quota, allocatable = q.alloc, q.fair, q.quota, q.allocatable
        a0, a1, a2 = alloc[0], alloc[1], alloc[2]
        w0, w1, w2 = a0 + req[0], a1 + req[1], a2 + req[2]
        self.over = a0 > fair[0] + EPS and a1 > fair[1] + EPS and a2 > fair[2] + EPS
        self.outside = w0 > quota[0] + EPS or w1 > quota[1] + EPS or w2 > quota[2] + EPS
        self.priority = q.priority
        self.penalised = (
            (allocatable[0] <= 0 and w0 > EPS)
            or (allocatable[1] <= 0 and w1 > EPS)
            or (allocatable[2] <= 0 and w2 > EPS)
        )
        self.with_job = _dominant_share(w0, w1, w2, allocatable)
        self.without_job = _dominant_share(a0, a1, a2, allocatable)
        self.allocatable = allocatable
        self.index = q.index

    def before(self, other: QueueRank) -> bool:
        if self.over != other.over:
            return other.over
        if self.outside != other.outside:
            return other.outside
        if self.priority != other.priority:
            return self.priority > other.priority
        if self.penalised != other.penalised:
            return other.penalised
        if self.with_job != other.with_job:
            return self.with_job < other.with_job
        if self.without_job != other.without_job:
            return self.without_job < other.without_job
        if _weaker(self.allocatable, other.allocatable):
            return True
        if _weaker(other.allocatable, self.allocatable):
            return False
        return self.index < other.index


def _weaker(a: Vector, b: Vector) -> bool:
    """KAI prioritizeBasedOnAllocatableShare: no larger in every resource, smaller in one."""
    return a[0] <= b[0] and a[1] <= b[1] and a[2] <= b[2] and (a[0] < b[0] or a[1] < b[1] or a[2] < b[2])


_NO_SHARE = 1000.0  # KAI noFairShareDrfMultiplier: use of a resource with a zero allocatable share


def _dominant_share(gpu: float, cpu: float, mem: float, allocatable: Vector) -> float:
    """The largest share of the allocatable share, each resource in KAI's units (GPUs, millicores, megabytes)
    where that share is zero."""
    g = _share(gpu, allocatable[0], 1.0 / MILLI)
    c = _share(cpu, allocatable[1], 1.0)
    m = _share(mem, allocatable[2], 1e-6)
    top = g if g > 0.0 else 0.0  # max() costs a call on this hot path
    top = c if c > top else top
    return m if m > top else top


def _share(used: float, base: float, unit: float) -> float:
    return used / base if base > 0 else used * unit * _NO_SHARE


Ranked = tuple[Job, Vector, QueueRank]  # a subtree's best job, its request, the key


class JobOrder:
    """Pending jobs in queue order: a walk from the top of the queue tree, at each level taking the child whose
    best job ranks first. Cached per subtree with the subtree's own rank; a subtree is re-ranked only when its
    allocation or its jobs changed, so a pop re-ranks one path of the tree."""

    def __init__(self, session: Session, jobs: Iterable[Job]) -> None:
        self.session = session
        for q in session.queues:
            q.heap = []
            q.ranked_valid = False
        for job in jobs:
            job.queue.heap.append(self._entry(job))
        for q in session.queues:
            heapq.heapify(q.heap)  # entries are unique (job index), so the pop order is the push order's
        self.best: Ranked | None = None  # over the whole tree
        self.best_valid = False
        session.dirty.clear()

    def push(self, job: Job) -> None:
        heapq.heappush(job.queue.heap, self._entry(job))
        self.session.dirty.add(job.queue)

    @staticmethod
    def _entry(job: Job) -> _Entry:
        # the request that ranks the job's queue: its next chunk (fixed while the job waits in the heap)
        req = job.chunk_request() if job.chunk() is not None else request_of(job.pending()[:1])
        priority, standing, created, index = job.key()
        return (priority, standing, created, index, job, req)  # flat: cheaper to compare than a nested key

    def pop(self) -> Job | None:
        self._invalidate()
        if not self.best_valid:
            self.best = self._first(self.session.tops)
            self.best_valid = True
        if self.best is None:
            return None
        job = self.best[0]
        heapq.heappop(job.queue.heap)
        self.session.dirty.add(job.queue)
        return job

    def _invalidate(self) -> None:
        dirty = self.session.dirty
        if dirty:
            for q in dirty:
                for a in q.path:
                    a.ranked_valid = False
            self.best_valid = False
            dirty.clear()

    def _first(self, queues: list[Queue]) -> Ranked | None:
        """The best of the queues' best jobs, by each queue's rank."""
        found: Ranked | None = None
        for q in queues:
            candidate = q.ranked if q.ranked_valid else self._rank(q)
            if candidate is not None and (found is None or candidate[2].before(found[2])):
                found = candidate
        return found

    def _rank(self, q: Queue) -> Ranked | None:
        found: Ranked | None = None
        if not q.children:
            if q.heap:
                top = q.heap[0]
                found = (top[4], top[5], QueueRank(q, top[5]))
        else:
            best = self._first(q.children)
            if best is not None:
                found = (best[0], best[1], QueueRank(q, best[1]))
        q.ranked, q.ranked_valid = found, True
        return found


def gpu_request(pods: Iterable[Pod]) -> float:
    return float(sum(p.spec.gpu_milli for p in pods))
