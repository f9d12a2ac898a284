"""One arbiter cycle over a snapshot, and rounds of cycles: what the `simulate` command runs.

A round runs the listed actions once, in order, on a fresh session. Between rounds bound pods are running,
and evicted, releasing and pipelined pods are pending again (their releases finished; the arbiter decides
afresh where they go).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Literal

from agent.arbiter.core.allocate import allocate
from agent.arbiter.core.consolidate import consolidate
from agent.arbiter.core.evict import preempt, reclaim
from agent.arbiter.core.model import MILLI, JobSpec, PodSpec, PodStatus, Snapshot, Vector
from agent.arbiter.core.session import Cause, Job, Pod, Session

ACTIONS: dict[str, Callable[[Session], None]] = {
    "allocate": allocate,
    "consolidate": consolidate,
    "reclaim": reclaim,
    "preempt": preempt,
}
DEFAULT_ACTIONS = ("allocate", "consolidate", "reclaim", "preempt")

Outcome = Literal["running", "pending", "evicted"]
Action = Literal["bind", "pipeline", "evict", "keep"]


# The two decisions a cycle makes by the ten thousand write their own `__init__`: compiled, an explicit one
# stores the fields natively (0.08 us), where the dataclass-made one runs as Python (1 us, 0.15 s a 140,000-pod
# cycle). They stay frozen: `object.__setattr__` is how a frozen dataclass sets its own fields.
@dataclass(frozen=True, slots=True, init=False)
class PodDecision:
    outcome: Outcome
    node: str | None
    action: Action
    gpu_index: int | None = None  # the shared GPU of a fractional pod
    moved_to: str | None = None  # consolidation: the node an evicted pod is promised
    cause: Cause | None = None  # which action evicted it
    gpus: tuple[int, ...] = ()  # every GPU index of its seat (whole-GPU pods too): what a commit reserves
    evicted_for: tuple[str, str] | None = None  # evicted: the (job, queue) it makes room for

    def __init__(
        self,
        outcome: Outcome,
        node: str | None,
        action: Action,
        gpu_index: int | None = None,
        *,
        moved_to: str | None = None,
        cause: Cause | None = None,
        gpus: tuple[int, ...] = (),
        evicted_for: tuple[str, str] | None = None,
    ) -> None:
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "action", action)
        object.__setattr__(self, "gpu_index", gpu_index)
        object.__setattr__(self, "moved_to", moved_to)
        object.__setattr__(self, "cause", cause)
        object.__setattr__(self, "gpus", gpus)
        object.__setattr__(self, "evicted_for", evicted_for)


@dataclass(frozen=True, slots=True, init=False)
class Eviction:
    pod: str
    queue: str
    cause: Cause

    def __init__(self, pod: str, queue: str, cause: Cause) -> None:
        object.__setattr__(self, "pod", pod)
        object.__setattr__(self, "queue", queue)
        object.__setattr__(self, "cause", cause)


@dataclass(frozen=True, slots=True)
class Admission:
    job: str
    queue: str
    created_at: float


@dataclass(frozen=True, slots=True)
class CycleResult:
    pods: dict[str, PodDecision]
    fair_share: dict[str, Vector]  # per queue; GPUs in milli-GPUs
    allocated: dict[str, Vector]  # per queue after the cycle (running, bound and pipelined pods)
    pending_jobs: dict[str, int]  # per leaf queue: jobs still below minMember or with pending pods
    evictions: tuple[Eviction, ...]
    admissions: tuple[Admission, ...]  # gangs that reached minMember with every member bound
    before: Snapshot  # the snapshot the cycle decided over
    # (queue, protection) -> jobs it shields this cycle: "preemptMinRuntime" and "reclaimMinRuntime" (running
    # jobs too young to be victims), "preemptionDelay" (pending jobs not yet allowed to evict)
    protected: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def usage(self) -> dict[str, Vector]:
        """Time-aware fair share: each queue's normalised past usage the division was given."""
        return dict(self.before.fairness.usage)

    @property
    def next(self) -> Snapshot:
        """The snapshot the next round starts from. Built on demand, each time: the simulator's world moving
        on is not the arbiter's work, and a last round needs none."""
        return _next_snapshot(self.before, self.pods)


def unknown_actions(actions: Sequence[str]) -> list[str]:
    return [a for a in actions if a not in ACTIONS]


def run_cycle(snapshot: Snapshot, actions: Sequence[str] = DEFAULT_ACTIONS) -> CycleResult:
    with gc_paused():
        session = Session(snapshot)
        for name in actions:
            ACTIONS[name](session)
        return _result(session, snapshot)


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection during a cycle. A cycle allocates an object per pod and job plus one per
    tentative move, and almost none of it is garbage before the cycle ends; left on, the collector rescans the
    growing heap again and again (a third of the cycle at 140,000 pods). What the cycle leaves behind is
    collected after it, the next time the collector runs."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def fair_share_in_units(share: Vector) -> dict[str, float]:
    """A fair-share vector in the snapshot's units (GPUs as devices)."""
    return {"gpu": share[0] / MILLI, "cpu": share[1], "memory": share[2]}


WAITING = PodDecision("pending", None, "keep")  # most pods of a large snapshot: one shared (frozen) decision


def decide(session: Session, pod: Pod) -> PodDecision:
    if pod.state == "pending":
        return WAITING
    nodes = session.cluster.nodes
    node = nodes[pod.seat.node].spec.name if pod.seat is not None else None
    gpus = pod.seat.gpus if pod.seat is not None else ()
    index = gpus[0] if pod.spec.fractional and gpus else None
    if pod.state == "running":
        return PodDecision("running", node, "keep", index, gpus=gpus)
    if pod.state == "bound":
        return PodDecision("running", node, "bind", index, gpus=gpus)
    if pod.state == "pipelined":
        return PodDecision("pending", node, "pipeline", index, gpus=gpus)
    if pod.state == "evicted":
        moved = nodes[pod.moved_to.node].spec.name if pod.moved_to is not None else None
        beneficiary = pod.evicted_for
        evicted_for = (beneficiary.spec.name, beneficiary.queue.spec.name) if beneficiary is not None else None
        return PodDecision(
            "evicted", node, "evict", index, moved_to=moved, cause=pod.cause, gpus=gpus, evicted_for=evicted_for
        )
    if pod.state == "releasing":
        return PodDecision("evicted", node, "keep", index, gpus=gpus)
    return WAITING


def _result(session: Session, snapshot: Snapshot) -> CycleResult:
    pods = {p.spec.name: decide(session, p) for p in session.pods}
    evictions = tuple(
        Eviction(p.spec.name, p.job.queue.spec.name, p.cause)
        for p in session.pods
        if p.state == "evicted" and p.cause is not None
    )
    admissions = []
    pending: dict[str, int] = {q.spec.name: 0 for q in session.queues if not q.children}
    for job in session.jobs:
        if admitted(job):
            admissions.append(Admission(job.spec.name, job.queue.spec.name, job.spec.created_at))
        if waiting(job):
            pending[job.queue.spec.name] += 1
    return assemble(session, snapshot, pods=pods, evictions=evictions, admissions=admissions, pending=pending)


def admitted(job: Job) -> bool:
    """The gang reached minMember this cycle with every member bound."""
    before = sum(1 for p in job.pods if p.was == "running")
    bound = sum(1 for p in job.pods if p.state in ("running", "bound"))
    return before < job.spec.min_member <= bound and job.active == bound


def waiting(job: Job) -> bool:
    """The gang is below minMember or has pods still pending (CycleResult.pending_jobs)."""
    return job.active < job.spec.min_member or any(p.state == "pending" for p in job.pods)


def assemble(
    session: Session,
    snapshot: Snapshot,
    *,
    pods: dict[str, PodDecision],
    evictions: tuple[Eviction, ...],
    admissions: list[Admission],
    pending: dict[str, int],
) -> CycleResult:
    return CycleResult(
        protected=_protected(session),
        pods=pods,
        fair_share={q.spec.name: q.fair for q in session.queues},
        allocated={q.spec.name: (q.alloc[0], q.alloc[1], q.alloc[2]) for q in session.queues},
        pending_jobs=pending,
        evictions=evictions,
        admissions=tuple(admissions),
        before=snapshot,
    )


def _protected(session: Session) -> dict[tuple[str, str], int]:
    now = session.now
    counts: dict[tuple[str, str], int] = {}
    if now is None:
        return counts
    for job in session.jobs:
        queue = job.queue
        started = job.spec.started_at
        if job.running and job.preemptible and started is not None:
            if now < started + session.preempt_min_runtime(queue):
                key = (queue.spec.name, "preemptMinRuntime")
                counts[key] = counts.get(key, 0) + 1
            if now < started + session.reclaim_min_runtime(queue, queue):
                key = (queue.spec.name, "reclaimMinRuntime")
                counts[key] = counts.get(key, 0) + 1
        if job.pending() and not session.may_evict_for(job):
            key = (queue.spec.name, "preemptionDelay")
            counts[key] = counts.get(key, 0) + 1
    return counts


def _next_snapshot(snapshot: Snapshot, pods: dict[str, PodDecision]) -> Snapshot:
    def advance(pod: PodSpec) -> PodSpec:
        decision = pods[pod.name]
        status: PodStatus
        if decision.outcome == "running":
            status, node, index = "Running", decision.node, decision.gpu_index
        else:
            status, node, index = "Pending", None, None
        if pod.status == status and pod.node == node and pod.gpu_index == index:
            return pod  # unchanged (most pods of a large snapshot): frozen, so shared
        return replace(pod, status=status, node=node, gpu_index=index)

    def advance_job(job: JobSpec) -> JobSpec:
        advanced = tuple(advance(p) for p in job.pods)
        if all(a is b for a, b in zip(advanced, job.pods, strict=True)):
            return job
        return replace(job, pods=advanced)

    return replace(snapshot, jobs=tuple(advance_job(j) for j in snapshot.jobs))


__all__ = ["ACTIONS", "DEFAULT_ACTIONS", "CycleResult", "PodDecision", "gc_paused", "run_cycle"]
