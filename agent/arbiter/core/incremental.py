"""The next cycle after a small change: the last cycle's session, returned to its state before the actions and
updated by what changed, instead of a session built whole from the snapshot.

Building a session reads every pod (140,000 at 4,000 nodes): it seats the placed ones, orders each gang's pods,
counts demand and fgd's workload; the result reads every pod again. Between two cycles of a running arbiter
almost all of that is unchanged. When the new snapshot differs from the last one only in gangs none of whose pods
is placed (a gang arrives, grows, shrinks, changes or leaves while it waits), in the clock and in past usage,
`CycleCache.run`:
- rolls the session back through its log to the state before the last cycle's actions (the quantities an undo
  recomputes by arithmetic are put back as they were, so not a bit differs);
- swaps in the changed gangs, and recomputes what depends on every pod from totals it keeps: fair shares (from
  each gang's total) and fgd's workload mix (from pod counts by GPU milli);
- runs the actions: the decision work itself, which no cache may skip, since one gang more can change the fair
  shares, the workload mix and the queue order that every later attempt depends on;
- builds the result from every pod's decision at rest, replacing only pods the surviving log names.
Any other change (a node, a queue, a placed pod, the placement policy) builds the session whole, as `run_cycle`
does. The decisions are `run_cycle`'s to the field (tests/unit/test_arbiter_cycle_cache.py compares them over
random event sequences).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from agent.arbiter.core.cycle import (
    ACTIONS,
    DEFAULT_ACTIONS,
    WAITING,
    Admission,
    CycleResult,
    Eviction,
    PodDecision,
    admitted,
    assemble,
    decide,
    gc_paused,
    waiting,
)
from agent.arbiter.core.fragments import ShapeScores, mix_of
from agent.arbiter.core.model import JobSpec, PodSpec, Snapshot
from agent.arbiter.core.session import Job, Pod, Session, shares_gpu


class CycleCache:
    """Runs cycles like `run_cycle`, keeping what the next one can reuse. One caller, one cycle at a time."""

    def __init__(self) -> None:
        self._session: Session | None = None
        self._snapshot: Snapshot | None = None
        self._jobs: dict[str, Job] = {}  # the session's jobs by name
        self._at_rest: dict[str, PodDecision] = {}  # every pod's decision before any action, in session order
        self._waiting_at_rest: dict[str, int] = {}  # per leaf queue: `waiting` jobs before any action
        self._workload: Counter[int] = Counter()  # pods by GPU milli: fgd's workload mix
        self._sharing = 0  # placed pods that may share a GPU (Session._load_placed seats them first)
        self._inexact = 0  # placed pods asking for CPU or memory not in whole units: totals that depend on order
        self.rebuilt = False  # whether the last cycle built its session whole

    def run(self, snapshot: Snapshot, actions: Sequence[str] = DEFAULT_ACTIONS) -> CycleResult:
        with gc_paused():
            session, self._session = self._session, None  # a cycle that raises leaves nothing half-used
            self.rebuilt = session is None or not self._update(session, snapshot)
            if session is None or self.rebuilt:
                session = self._build(snapshot)
            for name in actions:
                ACTIONS[name](session)
            result = self._result(session, snapshot)
            if len(self._jobs) == len(session.jobs) and len(self._at_rest) == len(session.pods):
                self._session, self._snapshot = session, snapshot  # names unique: a change can be found by name
            return result

    # -- a session built whole ----------------------------------------------------------------------------

    def _build(self, snapshot: Snapshot) -> Session:
        session = Session(snapshot)
        session.mark_rest()
        self._jobs = {j.spec.name: j for j in session.jobs}
        self._at_rest = {p.spec.name: decide(session, p) for p in session.pods}
        self._waiting_at_rest = {q.spec.name: 0 for q in session.queues if not q.children}
        for job in session.jobs:
            self._waiting_at_rest[job.queue.spec.name] += waiting(job)
        self._workload = Counter(p.spec.gpu_milli for p in session.pods)
        placed = [p for j in snapshot.jobs if _placed(j) for p in j.pods if p.node is not None]
        self._sharing = sum(1 for p in placed if shares_gpu(p))
        self._inexact = sum(1 for p in placed if _inexact(p))
        return session

    # -- a session updated --------------------------------------------------------------------------------

    def _update(self, session: Session, snapshot: Snapshot) -> bool:
        """Bring the last cycle's session back to rest and to `snapshot`; False (the session untouched) where the
        change is not one of gangs."""
        last = self._snapshot
        assert last is not None
        if snapshot.nodes != last.nodes or snapshot.queues != last.queues or snapshot.placement != last.placement:
            return False
        jobs = self._jobs
        kept: list[Job | None] = []  # per job of the snapshot: the session's, or None for a new one
        names: set[str] = set()
        previous = -1
        for spec in snapshot.jobs:
            job = jobs.get(spec.name)
            if spec.name in names or spec.queue not in session.by_name:
                return False
            names.add(spec.name)
            if job is not None and (job.spec is spec or job.spec == spec):
                if job.index < previous:
                    return False  # reordered
                previous = job.index
                kept.append(job)
            else:
                kept.append(None)
        staying = {j: None for j in kept if j is not None}
        gone = [j for j in jobs.values() if j not in staying]
        arriving = [spec for spec, job in zip(snapshot.jobs, kept, strict=True) if job is None]
        # pod names stay unique, so the result can be kept by name
        leaving = {p.spec.name for j in gone for p in j.pods}
        names_in = [p.name for spec in arriving for p in spec.pods]
        if len(set(names_in)) != len(names_in) or any(n in self._at_rest and n not in leaving for n in names_in):
            return False
        # placed pods that come or go: their nodes are loaded again, as a session built whole loads them, where
        # that gives what a session built whole holds (the same load order; queue totals that sum exactly)
        placed_out = [p.spec for j in gone if _placed(j.spec) for p in j.pods if p.spec.node is not None]
        placed_in = [p for spec in arriving if _placed(spec) for p in spec.pods if p.node is not None]
        nodes = session.cluster.by_name
        if any(p.node not in nodes for p in placed_in):
            return False
        sharing = self._sharing + sum(map(shares_gpu, placed_in)) - sum(map(shares_gpu, placed_out))
        inexact = self._inexact + sum(map(_inexact, placed_in)) - sum(map(_inexact, placed_out))
        if (sharing > 0) != (self._sharing > 0) or inexact or self._inexact:
            return False
        self._sharing, self._inexact = sharing, inexact
        session.reset()  # here, not after the last cycle: a session built whole next needs none
        self._swap(session, snapshot, kept, gone)
        if placed_out or placed_in:
            self._reload(session, {nodes[p.node or ""] for p in (*placed_out, *placed_in)}, sharing > 0)
        session.now = snapshot.now
        session.compute_fair_shares(snapshot)
        return True

    def _swap(self, session: Session, snapshot: Snapshot, kept: list[Job | None], gone: list[Job]) -> None:
        workload, at_rest, waiting_at_rest = self._workload, self._at_rest, self._waiting_at_rest
        appended = not gone and all(k is not None for k in kept[: len(session.jobs)])
        for job in gone:
            del self._jobs[job.spec.name]
            waiting_at_rest[job.queue.spec.name] -= waiting(job)
            for p in job.pods:
                workload[p.spec.gpu_milli] -= 1
                del at_rest[p.spec.name]
        fresh: list[Job] = []
        session.jobs = []
        for index, (spec, same) in enumerate(zip(snapshot.jobs, kept, strict=True)):
            if same is None:
                job = session.new_job(spec, index)
                fresh.append(job)
                self._jobs[spec.name] = job
                for p in job.pods:
                    workload[p.spec.gpu_milli] += 1
                if not _placed(spec):
                    waiting_at_rest[job.queue.spec.name] += waiting(job)
            else:
                job = same
            job.index = index
            session.jobs.append(job)
        if appended:  # the common case, gangs arriving: the pods in order as they are, the new ones after
            for job in fresh:
                session.pods.extend(job.pods)
                for p in job.pods:
                    at_rest[p.spec.name] = WAITING
        else:
            session.pods = [p for j in session.jobs for p in j.pods]
            self._at_rest = {p.spec.name: at_rest.get(p.spec.name, WAITING) for p in session.pods}
        scores = session.cluster.scores
        if scores is not None and (fresh or gone):
            mix = mix_of(workload)
            if mix.kinds != scores.mix.kinds:
                session.cluster.scores = ShapeScores(mix)

    def _reload(self, session: Session, nodes: set[int], sort: bool) -> None:
        """Seat every pod placed on `nodes` again (the gone ones' pods are still listed there, the new ones' not
        yet), and what depends on those pods: their gangs' decisions at rest and whether they wait."""
        names = {session.cluster.nodes[n].spec.name for n in nodes}
        placed = [p for j in session.jobs for p in j.pods if p.spec.node in names]
        jobs = {p.job: None for p in placed}
        jobs.update(
            {p.job: None for n in nodes for p in session.node_pods[n] if self._jobs.get(p.job.spec.name) is p.job}
        )
        known = [j for j in jobs if any(p.state != "pending" for p in j.pods)]  # counted before, as at rest
        for job in known:
            self._waiting_at_rest[job.queue.spec.name] -= waiting(job)
        session.reload(sorted(nodes), placed, sort)
        for job in jobs:
            job.pending_changed()
            self._waiting_at_rest[job.queue.spec.name] += waiting(job)
            for p in job.pods:
                self._at_rest[p.spec.name] = decide(session, p)
        session.mark_rest()

    # -- the result -----------------------------------------------------------------------------------------

    def _result(self, session: Session, snapshot: Snapshot) -> CycleResult:
        """`cycle._result`, reading only the pods the surviving log names (the others are as at rest)."""
        moved: dict[Pod, None] = {op.pod: None for op in session.log}
        pods = dict(self._at_rest)
        for p in moved:
            pods[p.spec.name] = decide(session, p)
        ordered = sorted(moved, key=_session_order)
        evictions = tuple(
            Eviction(p.spec.name, p.job.queue.spec.name, p.cause)
            for p in ordered
            if p.state == "evicted" and p.cause is not None
        )
        pending = dict(self._waiting_at_rest)
        admissions: list[Admission] = []
        changed: dict[Job, None] = {p.job: None for p in ordered}
        for job in changed:
            if admitted(job):
                admissions.append(Admission(job.spec.name, job.queue.spec.name, job.spec.created_at))
            pending[job.queue.spec.name] += waiting(job) - _waited(job)
        return assemble(session, snapshot, pods=pods, evictions=evictions, admissions=admissions, pending=pending)


def _placed(spec: JobSpec) -> bool:
    return any(p.node is not None for p in spec.pods)


def _inexact(pod: PodSpec) -> bool:
    return not (float(pod.cpu_milli).is_integer() and float(pod.mem_bytes).is_integer())


def _session_order(pod: Pod) -> tuple[int, int]:
    return (pod.job.index, pod.job.pods.index(pod))


def _waited(job: Job) -> bool:
    """`waiting` at rest: before the actions, a pod is pending unless it was placed."""
    active = sum(1 for p in job.pods if p.was == "running")
    return active < job.spec.min_member or any(p.was == "pending" for p in job.pods)
