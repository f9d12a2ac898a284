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
from dataclasses import dataclass
from typing import Literal

from agent.arbiter.core.cluster import Cluster, Seat
from agent.arbiter.core.fairshare import fair_shares
from agent.arbiter.core.model import MILLI, UNLIMITED, JobSpec, PodSpec, QueueSpec, Snapshot, Vector
from agent.arbiter.core.snapshot import SnapshotError

EPS = 1e-6
State = Literal["running", "pending", "releasing", "bound", "pipelined", "evicted"]
Cause = Literal["reclaim", "preempt", "consolidate"]


class Queue:
    __slots__ = ("alloc", "alloc_np", "fair", "heap", "index", "limit", "parent", "path", "priority", "quota",
                 "quota_raw", "spec")

    def __init__(self, spec: QueueSpec, index: int) -> None:
        self.spec = spec
        self.index = index
        self.priority = spec.priority
        self.parent: Queue | None = None
        self.path: tuple[Queue, ...] = ()  # self, parent, ..., top-level queue
        self.alloc = [0.0, 0.0, 0.0]
        self.alloc_np = [0.0, 0.0, 0.0]  # held by non-preemptible jobs
        self.fair: Vector = (0.0, 0.0, 0.0)
        self.quota_raw = tuple(t.quota for t in spec.terms)
        self.quota: Vector = (0.0, 0.0, 0.0)  # -1 resolved to the level total
        self.limit = tuple(math.inf if t.limit == UNLIMITED else t.limit for t in spec.terms)
        self.heap: list[tuple[tuple[int, int, float, int], int, Job, list[float]]] = []


class Job:
    __slots__ = ("active", "gained", "index", "pods", "preemptible", "queue", "spec")

    def __init__(self, spec: JobSpec, index: int, queue: Queue) -> None:
        self.spec = spec
        self.index = index
        self.queue = queue
        self.preemptible = spec.preemptible
        self.pods: list[Pod] = []  # by task priority, highest first
        self.active = 0  # pods running, bound or pipelined (counted toward minMember)
        self.gained = 0  # pods bound or pipelined this cycle: such a job is no victim in the same cycle

    def key(self) -> tuple[int, int, float, int]:
        """Job order inside a leaf: priority, then gangs below minMember before at-min before elastic growth,
        then older first."""
        at = (self.active > self.spec.min_member) - (self.active < self.spec.min_member) + 1
        return (-self.spec.priority, at, self.spec.created_at, self.index)

    def pending(self) -> list[Pod]:
        return [p for p in self.pods if p.state == "pending"]

    def chunk(self) -> list[Pod] | None:
        """The pods to place next: the missing part of the gang, or one pod of elastic growth."""
        pending = self.pending()
        if not pending:
            return None
        if self.active >= self.spec.min_member:
            return pending[:1]
        missing = self.spec.min_member - self.active
        return pending[:missing] if len(pending) >= missing else None


class Pod:
    __slots__ = ("cause", "job", "moved_to", "req", "seat", "spec", "state", "was")

    def __init__(self, spec: PodSpec, job: Job) -> None:
        self.spec = spec
        self.req = spec.request
        self.job = job
        self.state: State = "pending"
        self.was: State = "pending"  # state at the start of the cycle
        self.seat: Seat | None = None
        self.moved_to: Seat | None = None
        self.cause: Cause | None = None


@dataclass(frozen=True, slots=True)
class _Op:
    kind: Literal["bind", "pipeline", "evict", "move", "restore", "demote"]
    pod: Pod
    seat: Seat | None


class Session:
    def __init__(self, snapshot: Snapshot) -> None:
        self.cluster = Cluster(snapshot.nodes, snapshot.placement)
        self.queues = [Queue(q, i) for i, q in enumerate(snapshot.queues)]
        by_name = {q.spec.name: q for q in self.queues}
        self.queue_by_name = by_name
        for q in self.queues:
            q.parent = by_name[q.spec.parent] if q.spec.parent is not None else None
        for q in self.queues:
            path: list[Queue] = []
            cur: Queue | None = q
            while cur is not None:
                path.append(cur)
                cur = cur.parent
            q.path = tuple(path)
        self.children: dict[Queue | None, list[Queue]] = {}
        for q in self.queues:
            self.children.setdefault(q.parent, []).append(q)
        self.jobs = [Job(j, i, by_name[j.queue]) for i, j in enumerate(snapshot.jobs)]
        self.pods: list[Pod] = []
        self.node_pods: list[list[Pod]] = [[] for _ in self.cluster.nodes]
        for job in self.jobs:
            specs = sorted(job.spec.pods, key=lambda p: (-p.task_priority, -p.gpu_milli, p.name))
            job.pods = [Pod(p, job) for p in specs]
            self.pods.extend(job.pods)
        self.log: list[_Op] = []
        self.dirty: set[Queue] = set()  # queues whose allocation changed: JobOrder re-ranks them
        self._load_placed()
        self._compute_fair_shares(snapshot)

    # -- setup ------------------------------------------------------------------------------------------

    def _load_placed(self) -> None:
        placed = [p for p in self.pods if p.spec.node is not None]
        # fractional pods with a known GPU first, so whole-GPU pods take the devices nobody shares
        placed.sort(key=lambda p: (p.spec.gpu_index is None, p.spec.fractional))
        for pod in placed:
            node = self.cluster.nodes[self.cluster.by_name[pod.spec.node or ""]]
            running = pod.spec.status == "Running"
            seat = self._initial_seat(pod)
            if seat is None:
                raise SnapshotError(f"pod {pod.spec.name!r} does not fit on node {node.spec.name!r} beside the "
                                    "other pods placed there.")
            self.cluster.occupy(pod.spec, seat, now=True, after=running, sign=1)
            pod.seat = seat
            pod.state = pod.was = "running" if running else "releasing"
            if running:
                self._account(pod, 1)
                pod.job.active += 1
            else:
                self.cluster.mark_release(seat.node, 1)
            self.node_pods[seat.node].append(pod)

    def _initial_seat(self, pod: Pod) -> Seat | None:
        node = self.cluster.nodes[self.cluster.by_name[pod.spec.node or ""]]
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
        held = [g for p in self.node_pods[node.index] if p.job is pod.job and p.seat for g in p.seat.gpus]
        free = [g for g in range(node.spec.gpus) if node.gpu_now[g] == 0]
        if len(free) < count:
            return None
        for domain in sorted(node.domains, key=lambda d: not set(held).intersection(d)):
            mine = [g for g in domain if node.gpu_now[g] == 0]
            if len(mine) >= count:
                return Seat(node.index, tuple(mine[:count]))
        return Seat(node.index, tuple(free[:count]))

    def _compute_fair_shares(self, snapshot: Snapshot) -> None:
        demand: dict[str, Vector] = {}
        for job in self.jobs:
            total = [0.0, 0.0, 0.0]
            for pod in job.pods:
                for r, v in enumerate(pod.spec.request):
                    total[r] += v
            prev = demand.get(job.queue.spec.name, (0.0, 0.0, 0.0))
            demand[job.queue.spec.name] = (prev[0] + total[0], prev[1] + total[1], prev[2] + total[2])
        nodes = snapshot.nodes
        capacity: Vector = (
            float(sum(n.gpus for n in nodes) * MILLI),
            float(sum(n.cpu_milli for n in nodes)),
            float(sum(n.mem_bytes for n in nodes)),
        )
        self.capacity = capacity
        shares = fair_shares(snapshot.queues, demand, capacity)
        for q in self.queues:
            q.fair = shares[q.spec.name]
            level = capacity if q.parent is None else q.parent.fair
            quota = [level[r] if raw == UNLIMITED else raw for r, raw in enumerate(q.quota_raw)]
            q.quota = (quota[0], quota[1], quota[2])

    # -- checks -----------------------------------------------------------------------------------------

    def admissible(self, job: Job, req: Sequence[float]) -> bool:
        """Limits hold at every ancestor; a non-preemptible job stays within quota at every ancestor."""
        for q in job.queue.path:
            for r in range(3):
                if req[r] and q.alloc[r] + req[r] > q.limit[r] + EPS:
                    return False
                capped = not job.preemptible and req[r] and q.quota_raw[r] != UNLIMITED
                if capped and q.alloc_np[r] + req[r] > q.quota_raw[r] + EPS:
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

    def evict(self, pod: Pod, cause: Cause) -> None:
        assert pod.seat is not None and pod.state == "running"
        self.cluster.occupy(pod.spec, pod.seat, now=False, after=True, sign=-1)
        self.cluster.mark_release(pod.seat.node, 1)
        pod.state, pod.cause = "evicted", cause
        self._account(pod, -1)
        pod.job.active -= 1
        self.log.append(_Op("evict", pod, pod.seat))

    def restore(self, pod: Pod) -> None:
        """Take back an eviction the scenario turned out not to need."""
        assert pod.seat is not None and pod.state == "evicted"
        self.cluster.occupy(pod.spec, pod.seat, now=False, after=True, sign=1)
        self.cluster.mark_release(pod.seat.node, -1)
        pod.state, pod.cause = "running", None
        self._account(pod, 1)
        pod.job.active += 1
        self.log.append(_Op("restore", pod, pod.seat))

    def move(self, pod: Pod, seat: Seat) -> None:
        """An evicted pod is promised a new seat (consolidation): it keeps its job whole."""
        self.cluster.occupy(pod.spec, seat, now=False, after=True, sign=1)
        pod.moved_to = seat
        self._account(pod, 1)
        pod.job.active += 1
        self.log.append(_Op("move", pod, seat))

    def _enter(self, pod: Pod, seat: Seat, state: State) -> None:
        pod.seat, pod.state = seat, state
        self._account(pod, 1)
        pod.job.active += 1
        pod.job.gained += 1
        self.log.append(_Op("bind" if state == "bound" else "pipeline", pod, seat))

    def _undo(self, op: _Op) -> None:
        pod, seat = op.pod, op.seat
        assert seat is not None
        if op.kind in ("bind", "pipeline"):
            self.cluster.occupy(pod.spec, seat, now=op.kind == "bind", after=True, sign=-1)
            pod.seat, pod.state = None, "pending"
            self._account(pod, -1)
            pod.job.active -= 1
            pod.job.gained -= 1
        elif op.kind == "demote":
            self.cluster.occupy(pod.spec, seat, now=True, after=False, sign=1)
            pod.state = "bound"
        elif op.kind == "evict":
            self.cluster.occupy(pod.spec, seat, now=False, after=True, sign=1)
            self.cluster.mark_release(seat.node, -1)
            pod.state, pod.cause = "running", None
            self._account(pod, 1)
            pod.job.active += 1
        elif op.kind == "restore":
            self.cluster.occupy(pod.spec, seat, now=False, after=True, sign=-1)
            self.cluster.mark_release(seat.node, 1)
            pod.state = "evicted"
            self._account(pod, -1)
            pod.job.active -= 1
        else:  # move
            self.cluster.occupy(pod.spec, seat, now=False, after=True, sign=-1)
            pod.moved_to = None
            self._account(pod, -1)
            pod.job.active -= 1

    def _account(self, pod: Pod, sign: int) -> None:
        req = pod.req
        np = not pod.job.preemptible
        for q in pod.job.queue.path:
            alloc = q.alloc
            alloc[0] += sign * req[0]
            alloc[1] += sign * req[1]
            alloc[2] += sign * req[2]
            if np:
                q.alloc_np[0] += sign * req[0]
                q.alloc_np[1] += sign * req[1]
                q.alloc_np[2] += sign * req[2]
            self.dirty.add(q)


def request_of(pods: Iterable[Pod]) -> list[float]:
    total = [0.0, 0.0, 0.0]
    for p in pods:
        req = p.req
        total[0] += req[0]
        total[1] += req[1]
        total[2] += req[2]
    return total


def queue_key(q: Queue, req: Sequence[float]) -> tuple[bool, bool, int, float, int]:
    """Queue order (KAI's, condensed): over-served queues last; a job that stays within its queue's quota
    first; higher priority; smaller dominant share of max(quota, fair share) with the job; older queue."""
    alloc, fair, quota = q.alloc, q.fair, q.quota
    over = alloc[0] > fair[0] + EPS and alloc[1] > fair[1] + EPS and alloc[2] > fair[2] + EPS
    within = True
    share = 0.0
    for r in (0, 1, 2):
        want = alloc[r] + req[r]
        base = quota[r] if quota[r] > fair[r] else fair[r]
        if want > quota[r] + EPS:
            within = False
        ratio = want / base if base > 0 else (math.inf if want > EPS else 0.0)
        share = ratio if ratio > share else share  # max() costs a call on this hot path
    return (over, not within, -q.priority, share, q.index)


class JobOrder:
    """Pending jobs in queue order: a walk from the top of the queue tree, at each level taking the child whose
    best job ranks first. Cached per subtree; a subtree is re-ranked only when its allocation changed."""

    def __init__(self, session: Session, jobs: Iterable[Job]) -> None:
        self.session = session
        for q in session.queues:
            q.heap = []
        for job in jobs:
            self.push(job)
        self.best: dict[Queue | None, tuple[Job, list[float]] | None] = {}
        session.dirty.clear()

    def push(self, job: Job) -> None:
        # the request that ranks the job's queue: its next chunk (fixed while the job waits in the heap)
        req = request_of(job.chunk() or job.pending()[:1])
        heapq.heappush(job.queue.heap, (job.key(), job.index, job, req))
        self.session.dirty.add(job.queue)

    def pop(self) -> Job | None:
        self._invalidate()
        best = self._best(None)
        if best is None:
            return None
        job = best[0]
        heapq.heappop(job.queue.heap)
        self.session.dirty.add(job.queue)
        return job

    def _invalidate(self) -> None:
        for q in self.session.dirty:
            for a in q.path:
                self.best.pop(a, None)
            self.best.pop(None, None)
        self.session.dirty.clear()

    def _best(self, q: Queue | None) -> tuple[Job, list[float]] | None:
        if q in self.best:
            return self.best[q]
        kids = self.session.children.get(q, [])
        found: tuple[Job, list[float]] | None = None
        if q is not None and not kids:
            if q.heap:
                found = (q.heap[0][2], q.heap[0][3])
        else:
            rank = None
            for child in kids:
                candidate = self._best(child)
                if candidate is not None:
                    key = queue_key(child, candidate[1])
                    if rank is None or key < rank:
                        found, rank = candidate, key
        self.best[q] = found
        return found


def gpu_request(pods: Iterable[Pod]) -> float:
    return float(sum(p.spec.gpu_milli for p in pods))

