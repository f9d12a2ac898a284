"""Reclaim (across queues) and preempt (within a queue): evict running pods so a pending gang fits.

Both share one solver: victims are taken one unit at a time in victim order (a unit is one pod of elastic
growth above minMember, or the rest of a gang whole, so no gang is left below minMember); after each, the
pending chunk is tried (bind or pipeline onto the releasing resources). On success, victims the placement
turned out not to need are restored; on failure everything is rolled back.

- reclaim: only for a job whose queue stays within its fair share (at every level) with it; victims are
  preemptible jobs of other queues, most over-served queue first, and a victim is taken only if its queue,
  and each of its ancestors below the level where the two hierarchies meet, stays at or above fair share in
  the contended resource (GPUs for GPU jobs, else CPU and memory).
- preempt: victims are preemptible jobs of the same queue with strictly lower priority.
Non-preemptible jobs (priority >= 100 by default) are never victims and may only claim resources in quota.

At scale most pending jobs can take nothing, so the checks that end a scenario before it starts come first
(a preemptor with no lower priority in its queue, a reclaimer at its fair share), and a victim queue's scan
stops as soon as even its smallest unit would take it below fair share. None of them changes a decision.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from agent.arbiter.core.model import CPU, GPU, MEMORY, Vector
from agent.arbiter.core.placing import chunk_shape, place_chunk
from agent.arbiter.core.session import (
    EPS,
    Cause,
    Job,
    JobOrder,
    Pod,
    Queue,
    Session,
    gpu_request,
    queue_key,
    request_of,
)

Unit = list[Pod]


def reclaim(session: Session) -> None:
    _run(session, "reclaim")


def preempt(session: Session) -> None:
    _run(session, "preempt")


def _run(session: Session, cause: Cause) -> None:
    order = JobOrder(session, (j for j in session.jobs if j.chunk() is not None))
    # candidate victims per queue, cheapest first: lowest priority, then newest
    by_queue: dict[Queue, list[Job]] = {}
    for j in session.jobs:
        if j.preemptible and j.running:
            by_queue.setdefault(j.queue, []).append(j)
    for jobs in by_queue.values():
        jobs.sort(key=lambda j: (j.spec.priority, -j.spec.created_at, -j.index))
    # the least any unit of a queue frees, per resource: victims are pods running when the action starts (a
    # restore only puts one back), so the bound holds throughout and ends the scan of a queue early
    least = {q: _least(jobs) for q, jobs in by_queue.items()}
    hopeless: set[tuple[object, ...]] = set()  # chunk shapes that found no victims in their queue
    while (job := order.pop()) is not None:
        chunk = job.chunk()
        if chunk is None:
            continue
        req = job.chunk_request()
        if cause == "preempt" and not _has_lower_priority(job, by_queue):
            continue  # nothing to take in its queue: the scenario would change nothing
        if cause == "reclaim" and not _within_fair_share(job.queue, req):
            continue
        if not session.admissible(job, req):
            continue
        attempt = (job.queue.index, job.spec.priority, chunk_shape(chunk))
        if attempt in hopeless:
            continue
        reclaiming = cause == "reclaim"
        victims = _reclaim_victims(job, req, by_queue, least) if reclaiming else _preempt_victims(job, by_queue)
        if _solve(session, job, chunk, victims, cause=cause):
            if job.chunk() is not None:
                order.push(job)
        else:
            hopeless.add(attempt)


def _solve(session: Session, job: Job, chunk: Sequence[Pod], victims: Iterator[Unit], *, cause: Cause) -> bool:
    mark = session.checkpoint()
    taken: list[Unit] = []
    need = gpu_request(chunk)
    cluster = session.cluster
    for unit in victims:
        for pod in unit:
            session.evict(pod, cause)
        taken.append(unit)
        if cluster.gpu_after_free < need:
            continue
        if place_chunk(session, job, chunk):
            _restore_unneeded(session, taken)
            return True
    session.rollback(mark)
    return False


def _restore_unneeded(session: Session, taken: list[Unit]) -> None:
    for unit in reversed(taken):
        job = unit[0].job
        if job.active + len(unit) < job.spec.min_member:
            continue  # an elastic pod alone would leave its gang below minMember: it stays evicted
        mark = session.checkpoint()
        for pod in unit:
            assert pod.seat is not None
            if not session.cluster.seat_free(pod.spec, pod.seat, bind=False):
                session.rollback(mark)
                break
            session.restore(pod)


def _units(job: Job) -> list[Unit]:
    """Elastic pods above minMember one by one (lowest task priority first), then the rest of the gang; every
    unit holds running pods only."""
    running = [p for p in reversed(job.pods) if p.state == "running"]
    extra = max(0, len(running) - job.spec.min_member)
    units = [[pod] for pod in running[:extra]]
    if running[extra:]:
        units.append(running[extra:])
    return units


def _usable(job: Job) -> bool:
    # a job that gained pods this cycle is not a victim in the same cycle; one with nothing running has nothing
    return job.gained == 0 and job.running > 0


def _reclaim_victims(
    job: Job, req: Sequence[float], by_queue: dict[Queue, list[Job]], least: dict[Queue, Vector]
) -> Iterator[Unit]:
    """Units of other queues' jobs, most over-served queue first, each yielded only if taking it now keeps both
    sides fair, at every level below where the two hierarchies meet: the reclaimer's queues stay within their
    fair share with the job, the victim's stay at or above theirs in the contended resource (GPUs for GPU jobs,
    else CPU and memory). Checked when the unit comes up, after the units taken before it."""
    mine = job.queue
    ours = mine.path
    gpu = req[GPU] > 0
    contended = (GPU,) if gpu else (CPU, MEMORY)
    zero = (0.0, 0.0, 0.0)
    queues = sorted((q for q in by_queue if q is not mine), key=lambda q: _neg(queue_key(q, zero)))
    for q in queues:
        theirs: list[Queue] = []
        for a in q.path:
            if a in ours:
                break
            theirs.append(a)
        # the reclaimer's side below the meeting point: taking from q does not change it
        if not all(_within_fair_share(a, req) for a in ours if a not in q.path):
            continue
        for victim in by_queue[q]:
            if gpu and q.alloc[GPU] <= q.fair[GPU] + EPS:
                break  # at or below its fair share: nothing more can be taken from this queue
            if not _stays_fair(theirs, contended, least[q]):
                break  # even the smallest unit would take the victim's side below its fair share
            if _usable(victim):
                for unit in _units(victim):
                    if _stays_fair(theirs, contended, request_of(unit)):
                        yield unit


def _least(jobs: Sequence[Job]) -> Vector:
    running = [p.req for j in jobs for p in j.pods if p.state == "running"]
    return (min(r[0] for r in running), min(r[1] for r in running), min(r[2] for r in running))


def _stays_fair(theirs: Sequence[Queue], contended: Sequence[int], freed: Sequence[float]) -> bool:
    for a in theirs:
        for r in contended:
            if freed[r] > 0 and a.alloc[r] - freed[r] < a.fair[r] - EPS:
                return False
    return True


def _has_lower_priority(job: Job, by_queue: dict[Queue, list[Job]]) -> bool:
    jobs = by_queue.get(job.queue)  # never empty: cheapest first
    return jobs is not None and jobs[0].spec.priority < job.spec.priority


def _preempt_victims(job: Job, by_queue: dict[Queue, list[Job]]) -> Iterator[Unit]:
    priority = job.spec.priority
    for victim in by_queue.get(job.queue, []):
        if victim.spec.priority >= priority:
            break
        if victim is not job and _usable(victim):
            yield from _units(victim)


def _neg(key: tuple[bool, bool, int, float, int]) -> tuple[bool, bool, int, float, int]:
    over, outside, prio, share, index = key
    return (not over, not outside, -prio, -share, -index)


def _within_fair_share(queue: Queue, req: Sequence[float]) -> bool:
    return all(queue.alloc[r] + req[r] <= queue.fair[r] + EPS for r in range(3) if req[r] > 0)
