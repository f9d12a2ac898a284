"""Allocate: pending jobs in queue order, gangs all-or-nothing, then elastic growth one pod at a time.

Work-conserving: fair share orders the queues but does not cap them; only limits (at every ancestor) and,
for non-preemptible jobs, quota do. Within one allocate pass free capacity only shrinks, so a chunk shape
that failed to fit once is not tried again.
"""

from __future__ import annotations

from agent.arbiter.core.placing import chunk_shape, place_chunk
from agent.arbiter.core.session import JobOrder, Session


def allocate(session: Session) -> None:
    waiting = [j for j in session.jobs if j.chunk() is not None]
    order = JobOrder(session, waiting)
    failed: set[tuple[tuple[object, ...], ...]] = set()
    smallest = min((j.least_pending_gpu() for j in waiting), default=0)
    while (job := order.pop()) is not None:
        if session.cluster.gpu_after_free < smallest:
            break  # every pending pod needs more GPU than is left anywhere: nothing more can fit

        chunk = job.chunk()
        if chunk is None or not session.admissible(job, job.chunk_request()):
            continue
        shape = chunk_shape(chunk)
        if shape in failed:
            continue
        if not place_chunk(session, job, chunk):
            failed.add(shape)
            continue
        if job.chunk() is not None:
            order.push(job)  # re-queued after each commit, so elastic growth interleaves fairly
