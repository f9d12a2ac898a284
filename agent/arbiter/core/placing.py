"""Place a gang chunk all-or-nothing: bind where there is room now, pipeline onto resources being released."""

from __future__ import annotations

from collections.abc import Sequence

from agent.arbiter.core.model import MILLI
from agent.arbiter.core.session import Job, Pod, Session, gpu_request


def place_chunk(session: Session, job: Job, chunk: Sequence[Pod], exclude: int = -1) -> bool:
    """Seat every pod of `chunk` or none (the session is rolled back on failure).

    If any member of a gang has to wait for a release, the members that could bind wait too (pipelined), so
    the gang starts together.
    """
    cluster = session.cluster
    if gpu_request(chunk) > cluster.gpu_after_free:
        return False
    mark = session.checkpoint()
    held: dict[int, list[int]] = {}
    for p in job.pods:
        if p.seat is not None and p.state in ("running", "bound", "pipelined"):
            held.setdefault(p.seat.node, []).extend(p.seat.gpus)
    waiting = False
    gang_gpus = sum(p.spec.gpu_milli for p in chunk if not p.spec.fractional) // MILLI
    for pod in chunk:
        seat = cluster.find(pod.spec, True, held, exclude, gang_gpus)
        if seat is None and cluster.releasing:
            seat = cluster.find(pod.spec, False, held, exclude, gang_gpus)
            if seat is not None:
                session.pipeline(pod, seat)
                waiting = True
        elif seat is not None:
            session.bind(pod, seat)
        if seat is None:
            session.rollback(mark)
            return False
        if not pod.spec.fractional:
            gang_gpus -= pod.spec.gpu_milli // MILLI
        held.setdefault(seat.node, []).extend(seat.gpus)
    if waiting and len(chunk) > 1:
        for pod in chunk:
            if pod.state == "bound":
                session.demote(pod)
    return True


def chunk_shape(chunk: Sequence[Pod]) -> tuple[tuple[object, ...], ...]:
    """What decides whether a chunk fits, independent of its queue: used to skip repeats of a failed shape."""
    return tuple(p.shape for p in chunk)
