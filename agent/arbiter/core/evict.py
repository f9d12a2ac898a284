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
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from agent.arbiter.core.model import CPU, GPU, MEMORY
from agent.arbiter.core.placing import chunk_shape, place_chunk
from agent.arbiter.core.session import EPS, Cause, Job, JobOrder, Pod, Queue, Session, queue_key, request_of

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
        if j.preemptible and any(p.state == "running" for p in j.pods):
            by_queue.setdefault(j.queue, []).append(j)
    for jobs in by_queue.values():
        jobs.sort(key=lambda j: (j.spec.priority, -j.spec.created_at, -j.index))
    hopeless: set[tuple[object, ...]] = set()  # chunk shapes that found no victims in their queue
    while (job := order.pop()) is not None:
        chunk = job.chunk()
        if chunk is None:
            continue
        req = request_of(chunk)
        if not session.admissible(job, req):
            continue
        if cause == "reclaim" and not _within_fair_share(job.queue, req):
            continue
        attempt = (job.queue.index, job.spec.priority, chunk_shape(chunk))
        if attempt in hopeless:
            continue
        if cause == "reclaim":
            victims = _reclaim_victims(job, by_queue, gpu=req[GPU] > 0)
            valid = _keeps_fair_share(job, req)
        else:
            victims = _preempt_victims(job, by_queue)
            valid = _any
        if _solve(session, job, chunk, victims, valid=valid, cause=cause):
            if job.chunk() is not None:
                order.push(job)
        else:
            hopeless.add(attempt)


def _any(unit: Unit) -> bool:
    return True


def _solve(
    session: Session, job: Job, chunk: Sequence[Pod], victims: Iterator[Unit], *, valid: Callable[[Unit], bool],
    cause: Cause,
) -> bool:
    mark = session.checkpoint()
    taken: list[Unit] = []
    need = sum(p.spec.gpu_milli for p in chunk)
    for unit in victims:
        if any(p.state != "running" for p in unit) or not valid(unit):
            continue
        for pod in unit:
            session.evict(pod, cause)
        taken.append(unit)
        if session.cluster.gpu_after_free < need:
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


def _units(job: Job) -> Iterator[Unit]:
    """Elastic pods above minMember one by one (lowest task priority first), then the rest of the gang."""
    running = [p for p in reversed(job.pods) if p.state == "running"]
    extra = max(0, len(running) - job.spec.min_member)
    for pod in running[:extra]:
        yield [pod]
    if running[extra:]:
        yield running[extra:]


def _usable(job: Job) -> bool:
    # a job that gained pods this cycle is not a victim in the same cycle
    return job.gained == 0


def _reclaim_victims(job: Job, by_queue: dict[Queue, list[Job]], gpu: bool) -> Iterator[Unit]:
    mine = job.queue
    zero = (0.0, 0.0, 0.0)
    # most over-served queue first: reverse queue order
    queues = sorted((q for q in by_queue if q is not mine), key=lambda q: _neg(queue_key(q, zero)))
    for q in queues:
        for victim in by_queue[q]:
            if gpu and q.alloc[GPU] <= q.fair[GPU] + EPS:
                break  # at or below its fair share: nothing more can be taken from this queue
            if _usable(victim):
                yield from _units(victim)


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


def _keeps_fair_share(job: Job, req: Sequence[float]) -> Callable[[Unit], bool]:
    """Whether taking a unit keeps both sides fair, at every level below where the two hierarchies meet:
    the reclaimer's queues stay within their fair share with the job, the victim's stay at or above theirs."""
    contended = (GPU,) if req[GPU] > 0 else (CPU, MEMORY)
    ours = job.queue.path

    def valid(unit: Unit) -> bool:
        theirs = unit[0].job.queue.path
        for q in ours:
            if q in theirs:
                break
            if not _within_fair_share(q, req):
                return False
        freed = request_of(unit)
        for q in theirs:
            if q in ours:
                break
            for r in contended:
                if freed[r] > 0 and q.alloc[r] - freed[r] < q.fair[r] - EPS:
                    return False
        return True

    return valid
