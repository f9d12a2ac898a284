"""Consolidate: move preemptible running pods to defragment, so a pending preemptible gang fits.

Only for chunks that do not fit as things are while the cluster as a whole has enough free GPUs for them.
A job admitted while the gang was already waiting is not moved for it within one burst (evict.same_burst).
Victims are tried in reverse job order, as KAI's consolidation does: lowest priority first, then the newest
job, its pods by lowest task priority; at most `MAX_MOVES` per job. A scenario counts only if the chunk fits
and every moved pod gets a new seat (pipelined: it moves when its eviction completes), on another node or
another GPU of its own; a victim whose old seat is still free after all stays. No scenario loses a pod.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.arbiter.core.evict import same_burst, waiting_since
from agent.arbiter.core.placing import chunk_shape, place_chunk
from agent.arbiter.core.session import Job, JobOrder, Pod, Session, gpu_request

MAX_MOVES = 16  # KAI's default max-consolidation-preemptees


def consolidate(session: Session) -> None:
    waiting = [j for j in session.jobs if j.preemptible and j.chunk() is not None]
    # moves keep the free GPU total and every success takes from it, so it only shrinks: once it is below the
    # smallest pending pod, no chunk can pass the check below any more
    smallest = min((p.spec.gpu_milli for j in waiting for p in j.pending()), default=0)
    if session.cluster.gpu_after_free < smallest:
        return
    order = JobOrder(session, waiting)
    failed: set[tuple[tuple[object, ...], ...]] = set()
    while (job := order.pop()) is not None:
        if session.cluster.gpu_after_free < smallest:
            break
        chunk = job.chunk()
        if chunk is None or not session.admissible(job, job.chunk_request()):
            continue
        shape = chunk_shape(chunk)
        if shape in failed or gpu_request(chunk) > session.cluster.gpu_after_free:
            continue
        mark = session.checkpoint()
        if place_chunk(session, job, chunk):
            session.rollback(mark)  # fits without moving anything: that is allocate's business
            continue
        if _defragment(session, job, chunk):
            if job.chunk() is not None:
                order.push(job)
        else:
            failed.add(shape)


def _defragment(session: Session, job: Job, chunk: Sequence[Pod]) -> bool:
    mark = session.checkpoint()
    moved: list[Pod] = []
    for pod in _movable(session, job):
        session.evict(pod, "consolidate", job)
        moved.append(pod)
        trial = session.checkpoint()
        if place_chunk(session, job, chunk) and _reseat(session, moved):
            return True
        session.rollback(trial)
    session.rollback(mark)
    return False


def _reseat(session: Session, moved: Sequence[Pod]) -> bool:
    cluster = session.cluster
    for pod in sorted(moved, key=lambda p: -p.spec.gpu_milli):
        assert pod.seat is not None
        if cluster.seat_free(pod.spec, pod.seat, bind=False):
            session.restore(pod)  # the chunk did not need its place: it stays
            continue
        seat = cluster.find(pod.spec, True, {})
        if seat is None and cluster.releasing:
            seat = cluster.find(pod.spec, False, {})
        if seat is None:
            return False
        session.move(pod, seat)
    return True


def _movable(session: Session, job: Job) -> list[Pod]:
    """Victims in reverse job order: lowest priority, then newest job; inside a job, lowest task first."""
    jobs = sorted(
        (
            j
            for j in session.jobs
            if j is not job
            and j.preemptible
            and j.running
            and j.gained == 0
            and not j.spec.one_clique  # a pod moved alone could leave its gang's clique
            and not same_burst(j, session.now, waiting_since(job))
        ),
        key=lambda j: (j.spec.priority, -j.spec.created_at, -j.index),
    )
    pods: list[Pod] = []
    for victim in jobs:
        pods.extend(p for p in reversed(victim.pods) if p.state == "running")
        if len(pods) >= MAX_MOVES:
            break
    return pods[:MAX_MOVES]
