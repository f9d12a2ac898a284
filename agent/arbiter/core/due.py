"""When the clock alone can change a cycle's decisions over a snapshot.

A cycle reads the clock in a few places only: a running job is no victim while a queue's min-runtime protects it
(KAI's preemptMinRuntime and reclaimMinRuntime) or while it started in a waiting gang's burst
(`evict.SAME_BURST_S`), and a waiting job with a preemption delay evicts no one until the delay is over. Each is
a moment fixed by the snapshot; between two of them, a cycle over the same snapshot decides the same. The
arbiter sleeps until the next one when nothing it reads has changed (agent.arbiter.controller).
"""

from __future__ import annotations

import math

from agent.arbiter.core.evict import SAME_BURST_S
from agent.arbiter.core.model import Snapshot


def next_due(snapshot: Snapshot) -> float:
    """The first moment after `snapshot.now` at which a protection or a preemption delay ends: a cycle over
    this snapshot may decide otherwise from then on. math.inf when none is ahead, or the snapshot has no clock
    (then no time-based rule applies). Conservative: every min-runtime any queue sets counts for every job."""
    now = snapshot.now
    if now is None:
        return math.inf
    spans = {SAME_BURST_S}
    for q in snapshot.queues:
        spans.update(s for s in (q.preempt_min_runtime, q.reclaim_min_runtime) if s is not None and s > 0)
    due = math.inf
    for job in snapshot.jobs:
        if job.started_at is not None:
            for span in spans:
                at = job.started_at + span
                if now < at < due:
                    due = at
        if job.preemption_delay:
            since = job.pending_since if job.pending_since is not None else job.created_at
            at = since + job.preemption_delay
            if now < at < due:
                due = at
    return due


__all__ = ["next_due"]
