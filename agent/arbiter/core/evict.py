"""Reclaim (across queues) and preempt (within a queue): evict running pods so a pending gang fits.

Both share one solver, KAI's (actions/common/solvers): the pending chunk is tried first with no new victims
(onto what earlier scenarios freed and did not use), then victims are taken one unit at a time (a unit is one
pod of elastic growth above minMember, or the rest of a gang whole, so no gang is left below minMember); after
each, the chunk and the victims (with those earlier scenarios left evicted) go back through allocation
together in queue and job order, each job gang first: a victim whose queue ranks before the chunk's takes its
seat back first, and the chunk must then still fit (bind, or pipeline onto the releasing resources); each
victim that still fits, and whose queue stays within its limits, is restored; the rest stay evicted. On
failure everything is rolled back.

- reclaim (plugins/proportion/reclaimable): only for a job whose leaf queue stays within its fair share with
  it (and, non-preemptible, within quota). Victims are preemptible jobs of other queues, the victim queues
  ranked in reverse queue order, re-ranked after every pick. A victim is eligible when, at the level where the
  two queue branches meet, the victim side's queue, judged *before* the victim leaves, is above its
  allocatable share (max(quota, fair share), capped by its limit) in some resource (MaintainFairShare), or
  the reclaimer's side stays within quota with the job while the victim side is above quota
  (GuaranteeDeservedQuota). A queue at or under its quota is never a victim. Once the chunk fits, every
  ancestor of the reclaimer above its fair share must stay strictly below the saturation (allocation / fair
  share) of each victim-side sibling.
- preempt (actions/preempt): victims are preemptible jobs of the same queue with strictly lower priority; only
  "non-preemptible over quota" is checked before, the queue's limits once the victims have left.
- protections (plugins/minruntime; KAI v0.17 preemption delay): a job that started less than the queue's
  min runtime ago gives only its elastic pods; a pending job within its preemption delay evicts no one.
Non-preemptible jobs (priority >= 100 by default) are never victims and may only claim resources in quota.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from itertools import chain

from agent.arbiter.core.model import Vector
from agent.arbiter.core.placing import chunk_shape, place_chunk
from agent.arbiter.core.session import (
    EPS,
    Cause,
    Job,
    JobOrder,
    Pod,
    Queue,
    QueueRank,
    Session,
    gpu_request,
    request_of,
)

Unit = list[Pod]
SATURATION_MULTIPLIER = 1.0  # KAI's reclaimerSaturationMultiplier default
_ZERO = (0.0, 0.0, 0.0)


def reclaim(session: Session) -> None:
    _run(session, "reclaim")


def preempt(session: Session) -> None:
    _run(session, "preempt")


def _run(session: Session, cause: Cause) -> None:
    order = JobOrder(session, (j for j in session.jobs if j.chunk() is not None))
    # candidate victims per queue, cheapest first: lowest priority, then newest (reverse job order)
    by_queue: dict[Queue, list[Job]] = {}
    for j in session.jobs:
        if j.preemptible and j.running:
            by_queue.setdefault(j.queue, []).append(j)
    for jobs in by_queue.values():
        jobs.sort(key=lambda j: (j.spec.priority, -j.spec.created_at, -j.index))
    hopeless: set[tuple[object, ...]] = set()  # chunk shapes that found no victims in their queue
    able = _Able(session, cause, by_queue)
    while able.leaves and (job := order.pop()) is not None:
        able.popped(job.queue)
        chunk = job.chunk()
        if chunk is None or not session.may_evict_for(job):
            continue
        req = job.chunk_request()
        if cause == "preempt" and not _has_lower_priority(job, by_queue):
            continue  # nothing to take in its queue: the scenario would change nothing
        if cause == "reclaim" and not may_reclaim(job, req):
            continue
        if not session.within_np_quota(job, req):
            continue
        attempt = (job.queue.index, job.spec.priority, chunk_shape(chunk))
        if attempt in hopeless:
            continue
        if cause == "reclaim":
            victims = _reclaim_victims(session, job, req, by_queue)
            valid = reclaimers_within_boundaries
        else:
            victims = _preempt_victims(session, job, by_queue)
            valid = _no_further_check
        if _solve(session, job, chunk, victims, cause=cause, valid=valid):
            if job.chunk() is not None:
                order.push(job)
        else:
            hopeless.add(attempt)
        able.judge()


class _Able:
    """The leaf queues some waiting job of which may still evict, judged by what every such job needs: for
    reclaim, a leaf within its fair share (a job that keeps it there adds to it); for preempt, a job of higher
    priority than the cheapest victim its queue had when the action began (the heap's top is its highest).
    Between two scenarios tried the allocations stand still, so once no leaf is able every later pop would be
    passed over, and the action ends without them."""

    def __init__(self, session: Session, cause: Cause, by_queue: dict[Queue, list[Job]]) -> None:
        self._cause = cause
        self._by_queue = by_queue
        self._all = [q for q in session.queues if not q.children]
        self.leaves: set[Queue] = set()
        self.judge()

    def judge(self) -> None:
        """All leaves again, after a scenario was tried: taken, it moved allocations (and may have pushed its job
        back); rolled back, it restored them by arithmetic, which may differ in the last bit."""
        self.leaves = {q for q in self._all if self._able(q)}

    def popped(self, q: Queue) -> None:
        if not self._able(q):
            self.leaves.discard(q)

    def _able(self, q: Queue) -> bool:
        if not q.heap:
            return False
        top = q.heap[0][4]  # the leaf's waiting job of the highest priority
        if self._cause == "preempt":
            return _has_lower_priority(top, self._by_queue)
        return may_reclaim(top, _ZERO)  # any job's request only adds to its leaf's allocation


Check = Callable[[Session, Job, Sequence[float], Sequence[Unit]], bool]


def _solve(
    session: Session, job: Job, chunk: Sequence[Pod], victims: Iterator[Unit], *, cause: Cause, valid: Check
) -> bool:
    mark = session.checkpoint()
    taken: list[Unit] = []
    need = gpu_request(chunk)
    cluster = session.cluster
    # KAI's first scenario has no new victims (recorded victims only): what earlier scenarios freed and did not
    # use may already hold this chunk; evicting first would take a victim needlessly
    for unit in chain([[]], victims):
        for pod in unit:
            session.evict(pod, cause, job)
        if unit:
            taken.append(unit)
        if cluster.gpu_after_free < need:
            continue
        trial = session.checkpoint()
        # earlier scenarios' victims (of this action or an earlier one) too: what this one frees beyond its
        # need may fit one of them again, on the nodes it took victims from (elsewhere nothing was freed)
        left = session.victims
        freed = {p.seat.node for unit in taken for p in unit if p.seat is not None}
        earlier = sorted({id(u): (k, u) for n in freed for k, u in left.get(n, ())}.values(), key=_first)
        if (
            _reallocate(session, job, chunk, [u for _, u in earlier] + taken)
            and session.limits_hold(job)
            and valid(session, job, request_of(chunk), taken)
        ):
            _record(session, taken, {p.seat.node for _, u in earlier for p in u if p.seat is not None})
            return True
        session.rollback(trial)
    session.rollback(mark)
    return False


def _first(entry: tuple[tuple[int, int], Unit]) -> tuple[int, int]:
    return entry[0]


def _record(session: Session, taken: list[Unit], touched: set[int]) -> None:
    """Keep `session.victims` (per node, the units left evicted there, in eviction order) up to date once a
    scenario is taken: its own victims still evicted join, earlier ones restored on `touched` nodes leave. A unit
    comes back whole or not at all, and only running pods are taken, so no unit is listed twice."""
    left = session.victims
    for n in touched:
        left[n] = [(k, u) for k, u in left[n] if u[0].state == "evicted"]
    seq = len(session.log)
    for i, unit in enumerate(taken):
        if unit[0].state == "evicted":
            for n in {p.seat.node for p in unit if p.seat is not None}:
                left.setdefault(n, []).append(((seq, i), unit))


def _reallocate(session: Session, job: Job, chunk: Sequence[Pod], taken: list[Unit]) -> bool:
    """The pending chunk and the victims back through allocation together, in queue then job order (KAI
    actions/common TryToVirtuallyAllocatePreemptorAndGetVictims): a victim whose queue ranks before the
    chunk's takes its seat back first, and the scenario fails when the chunk then no longer fits. A unit that
    still fits where it ran and keeps its queue within its limits stays; a unit that would break a gang's
    minMember stays evicted.

    Like allocation, a job comes back gang first: the rest of its gang, then its elastic pods (highest task
    priority first), and the order is judged per job on its next unit and re-ranked after every restore. Ranking
    the units themselves would put a job's elastic pod (a smaller request) before the rest of its gang, where it
    cannot come back alone, and leave it evicted on a seat that stays free."""
    # taken holds a job's elastic pods (lowest task priority first), then its gang's rest: reversed, the order
    # in which they come back
    left: dict[Job, list[Unit]] = {}
    for unit in reversed(taken):
        left.setdefault(unit[0].job, []).append(unit)
    placed = False
    chunk_request = request_of(chunk)
    requests = {id(unit): request_of(unit) for unit in taken}  # asked for again at every pick

    def first() -> Job:
        # queue order, then job order: the job whose next unit comes back first
        ranked = [(QueueRank(j.queue, requests[id(units[0])]), j) for j, units in left.items()]
        best_rank, best = ranked[0]
        for rank, j in ranked[1:]:
            if _first_of(rank, j, best_rank, best):
                best_rank, best = rank, j
        return best

    while left:
        victim = first()
        if not placed and _before(job, chunk_request, victim, requests[id(left[victim][0])]):
            if not place_chunk(session, job, chunk):
                return False
            placed = True
            continue
        _restore_next(session, left, victim)
    return placed or place_chunk(session, job, chunk)


def _before(a: Job, a_req: Vector, b: Job, b_req: Vector) -> bool:
    """Whether job a (asking a_req) is allocated before job b, as KAI's queue tree walk orders them: by job
    order inside one queue, else by the queue order of the two branches where they meet."""
    if a.queue is not b.queue:
        qa, qb = _meeting(a.queue, b.queue)
        return _first_of(QueueRank(qa, a_req), a, QueueRank(qb, b_req), b)
    return a.key() < b.key()


def _first_of(a_rank: QueueRank, a: Job, b_rank: QueueRank, b: Job) -> bool:
    """Whether job a comes before job b by their queues' ranks, and by job order where the ranks tie."""
    return a_rank.before(b_rank) or (not b_rank.before(a_rank) and a.key() < b.key())


def _restore_next(session: Session, left: dict[Job, list[Unit]], job: Job) -> None:
    """The job's next unit back to its seats, if they are free and its queue's limits allow."""
    unit = left[job].pop(0)
    if not left[job]:
        del left[job]
    if job.active + len(unit) < job.spec.min_member:
        return  # an elastic pod alone would leave its gang below minMember: it stays evicted
    first = unit[0]
    assert first.seat is not None
    if not session.cluster.seat_free(first.spec, first.seat, bind=False):
        return  # the usual case: the chunk took its seat (checked first, it is the cheaper test)
    if not session.within_limits(job, request_of(unit)):
        return  # never back in breach of its queue's limit
    mark = session.checkpoint()
    for pod in unit:
        assert pod.seat is not None
        if not session.cluster.seat_free(pod.spec, pod.seat, bind=False):
            session.rollback(mark)
            return
        session.restore(pod)


def _units(job: Job, protected: bool) -> list[Unit]:
    """Elastic pods above minMember one by one (lowest task priority first), then the rest of the gang; every
    unit holds running pods only. A protected job (min runtime) gives its elastic pods only."""
    running = [p for p in reversed(job.pods) if p.state == "running"]
    extra = max(0, len(running) - job.spec.min_member)
    units = [[pod] for pod in running[:extra]]
    if running[extra:] and not protected:
        units.append(running[extra:])
    return units


def _usable(job: Job) -> bool:
    # a job that gained pods this cycle, or is being moved by consolidation, is not a victim in the same cycle;
    # one with nothing running has nothing to give
    return job.gained == 0 and job.running > 0 and not any(p.moved_to is not None for p in job.pods)


# -- reclaim ---------------------------------------------------------------------------------------------


def may_reclaim(job: Job, req: Sequence[float]) -> bool:
    """KAI CanReclaimResources: the leaf queue stays within its fair share with the job (ancestors are judged
    by saturation once the scenario is known)."""
    q = job.queue
    return all(q.alloc[r] + req[r] <= q.fair[r] + EPS for r in range(3))


def _meeting(mine: Queue, theirs: Queue) -> tuple[Queue, Queue]:
    """The two queues, one on each side, just below the level where the branches meet (KAI getLeveledQueues);
    two top-level queues meet at the root."""
    ours, other = mine.path[::-1], theirs.path[::-1]  # top-level first
    for a, b in zip(ours, other, strict=False):
        if a is not b:
            return a, b
    return ours[min(len(ours), len(other)) - 1], other[min(len(ours), len(other)) - 1]


def eligible(reclaimer: Queue, req: Sequence[float], victim: Queue) -> bool:
    """Whether a job of `victim` may be taken for a job of `reclaimer` asking `req`, judged on the victim
    side's allocation before it leaves (strategies.go: MaintainFairShare, then GuaranteeDeservedQuota)."""
    mine, theirs = _meeting(reclaimer, victim)
    alloc = theirs.alloc
    if any(alloc[r] > theirs.allocatable[r] + EPS for r in range(3)):
        return True  # above its allocatable share: reclaiming keeps fair share
    reclaimer_in_quota = all(mine.alloc[r] + req[r] <= mine.quota[r] + EPS for r in range(3))
    return reclaimer_in_quota and any(alloc[r] > theirs.quota[r] + EPS for r in range(3))


class _Reversed:
    """A queue rank compared the other way round: victim queues in reverse queue order."""

    __slots__ = ("rank",)

    def __init__(self, rank: QueueRank) -> None:
        self.rank = rank

    def __lt__(self, other: _Reversed) -> bool:
        return other.rank.before(self.rank)


def _reclaim_victims(
    session: Session, job: Job, req: Sequence[float], by_queue: dict[Queue, list[Job]]
) -> Iterator[Unit]:
    """Units of other queues' jobs: the most over-served eligible queue first, re-ranked after every pick
    (the solver evicts each unit before asking for the next)."""
    mine = job.queue
    now = session.now
    pending: dict[Queue, Iterator[Unit]] = {}
    for q, jobs in by_queue.items():
        if q is not mine:
            minimum = session.reclaim_min_runtime(mine, q)
            pending[q] = _queue_units(jobs, now, minimum, waiting_since=waiting_since(job))
    heads: dict[Queue, Unit] = {}
    while True:
        for q in list(pending):
            if q not in heads:
                unit = next(pending[q], None)
                if unit is None:
                    del pending[q]
                else:
                    heads[q] = unit
        ranked = sorted(heads, key=lambda q: _Reversed(QueueRank(q, _ZERO)))
        picked = next((q for q in ranked if eligible(mine, req, q)), None)
        if picked is None:
            return
        yield heads.pop(picked)


def _queue_units(
    jobs: Sequence[Job], now: float | None, min_runtime: float, waiting_since: float | None = None
) -> Iterator[Unit]:
    for victim in jobs:
        if _usable(victim) and not same_burst(victim, now, waiting_since):
            yield from _units(victim, _protected(victim, now, min_runtime))


# A job admitted while the reclaimer was already waiting was admitted by an allocate pass that weighed the
# reclaimer first (queue order) and found it did not fit: reclaiming it right after reverses a decision made
# on the same information. KAI never takes a victim from jobs allocated in its own session (`_usable`); the
# arbiter's admissions of one burst land over several cycles (each waits for its commits), so the rule
# extends to them for this long. Later the victim is fair game again, so the reclaimer cannot starve.
SAME_BURST_S = 30.0


def same_burst(victim: Job, now: float | None, waiting_since: float | None) -> bool:
    """Started after the reclaimer began waiting, less than SAME_BURST_S ago."""
    started = victim.spec.started_at
    if now is None or started is None or waiting_since is None:
        return False
    return waiting_since <= started and now < started + SAME_BURST_S


def waiting_since(job: Job) -> float:
    """When the job began waiting, for same_burst. A creationTimestamp is whole seconds, so a reclaimer created in
    the second a victim was admitted would count as waiting first and spare it for SAME_BURST_S: the arbiter
    passes `weighed_since` instead, a sub-second time on the same clock as the admissions it writes."""
    spec = job.spec
    return spec.weighed_since if spec.weighed_since is not None else spec.created_at


def _protected(victim: Job, now: float | None, min_runtime: float) -> bool:
    """Started less than `min_runtime` ago (KAI minruntime: LastStartTimestamp + min runtime after now)."""
    started = victim.spec.started_at
    return now is not None and started is not None and now < started + min_runtime


def reclaimers_within_boundaries(session: Session, job: Job, req: Sequence[float], taken: Sequence[Unit]) -> bool:
    """KAI reclaimingQueuesRemainWithinBoundaries, once the chunk is placed: at every level of the reclaimer's
    branch, a queue above its fair share stays strictly below each victim-side sibling's saturation in the
    resources involved; non-preemptible, it stays within quota too."""
    victims = [u for u in taken if u[0].state == "evicted"]
    involved_by_queue: dict[Queue, set[int]] = {}
    for unit in victims:
        freed = request_of(unit)
        for q in unit[0].job.queue.path:
            involved_by_queue.setdefault(q, set()).update(r for r in range(3) if freed[r] > 0)
    mine = {r for r in range(3) if req[r] > 0}
    for q in job.queue.path:
        for sibling, involved in involved_by_queue.items():
            if sibling is q or sibling.parent is not q.parent:
                continue
            for r in involved | mine:
                ratio = _saturation(q.alloc[r], q.fair[r])
                if (
                    ratio > 1 + EPS
                    and sibling.fair[r] > 0
                    and ratio * SATURATION_MULTIPLIER >= _saturation(sibling.alloc[r], sibling.fair[r]) - EPS
                ):
                    return False
    return True


def _saturation(alloc: float, fair: float) -> float:
    if fair <= 0:
        return float("inf") if alloc > EPS else 0.0
    return alloc / fair


# -- preempt ---------------------------------------------------------------------------------------------


def _has_lower_priority(job: Job, by_queue: dict[Queue, list[Job]]) -> bool:
    jobs = by_queue.get(job.queue)  # never empty: cheapest first
    return jobs is not None and jobs[0].spec.priority < job.spec.priority


def _preempt_victims(session: Session, job: Job, by_queue: dict[Queue, list[Job]]) -> Iterator[Unit]:
    priority = job.spec.priority
    now = session.now
    for victim in by_queue.get(job.queue, []):
        if victim.spec.priority >= priority:
            break
        if victim is not job and _usable(victim):
            yield from _units(victim, _protected(victim, now, session.preempt_min_runtime(job.queue)))


def _no_further_check(session: Session, job: Job, req: Sequence[float], taken: Sequence[Unit]) -> bool:
    """Preempt stays inside one queue: its limits, checked once the victims have left, are all there is."""
    return True
