"""Consolidate: move preemptible running pods to defragment, so a pending preemptible gang fits.

Only for chunks that do not fit as things are while the cluster as a whole has enough free GPUs for them.
Pods are moved from the emptiest nodes first (they are the closest to fitting a big pod), smallest first, at
most `MAX_MOVES` per job. A scenario counts only if the chunk fits and every moved pod gets a new seat on
another node (pipelined: it moves when its eviction completes); no scenario ever loses a pod.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.arbiter.core.model import MILLI
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
        session.evict(pod, "consolidate")
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
        origin = pod.seat.node
        seat = cluster.find(pod.spec, True, {}, exclude=origin)
        if seat is None and cluster.releasing:
            seat = cluster.find(pod.spec, False, {}, exclude=origin)
        if seat is None:
            return False
        session.move(pod, seat)
    return True


def _movable(session: Session, job: Job) -> list[Pod]:
    nodes = session.cluster.nodes
    ranked = sorted(
        (n for n in nodes if n.gpu_after.count(0) < n.spec.gpus),
        key=lambda n: (-n.gpu_after.count(0), -(n.spec.gpus * MILLI - sum(n.gpu_after)), n.index),
    )
    pods: list[Pod] = []
    for node in ranked:
        candidates = [
            p for p in session.node_pods[node.index]
            if p.state == "running" and p.job is not job and p.job.preemptible
            and p.job.gained == 0
        ]
        pods.extend(sorted(candidates, key=lambda p: (p.spec.gpu_milli, p.spec.name)))
        if len(pods) >= MAX_MOVES:
            break
    return pods[:MAX_MOVES]
