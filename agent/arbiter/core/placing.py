"""Place a gang chunk all-or-nothing: bind where there is room now, pipeline onto resources being released."""

from __future__ import annotations

from collections.abc import Sequence

from agent.arbiter.core.model import MILLI, PodSpec
from agent.arbiter.core.session import Job, Pod, Session, gpu_request


def place_chunk(session: Session, job: Job, chunk: Sequence[Pod], exclude: int = -1) -> bool:
    """Seat every pod of `chunk` or none (the session is rolled back on failure).

    If any member of a gang has to wait for a release, the members that could bind wait too (pipelined), so
    the gang starts together. A gang whose pods share a ComputeDomain (JobSpec.one_clique) is seated inside one
    NVLink clique: the clique its placed pods are in, else each clique in turn, the fullest first (a gang that
    fits a busy clique leaves whole cliques to larger gangs).
    """
    if not job.spec.one_clique:
        return _place(session, job, chunk, exclude, None)
    return any(_place(session, job, chunk, exclude, members) for members in clique_nodes(session, job))


def clique_nodes(session: Session, job: Job) -> list[frozenset[str]]:
    """The node names of each clique `job` may be seated in, in the order to try them."""
    nodes = session.cluster.nodes
    by_clique: dict[str, list[int]] = {}
    for node in nodes:
        if node.spec.clique is not None:
            by_clique.setdefault(node.spec.clique, []).append(node.index)
    held = next(
        (
            nodes[p.seat.node].spec.clique
            for p in job.pods
            if p.seat is not None and p.state in ("running", "bound", "pipelined")
        ),
        "",
    )
    if held != "":  # the gang is in a clique already (None: on a node in none, where no clique can follow)
        return [frozenset(nodes[i].spec.name for i in by_clique[held])] if held is not None else []
    order = sorted(by_clique, key=lambda c: (sum(nodes[i].after_free for i in by_clique[c]), c))
    return [frozenset(nodes[i].spec.name for i in by_clique[c]) for c in order]


def _within(spec: PodSpec, members: frozenset[str]) -> PodSpec:
    """The pod as if its rules allowed only `members`."""
    allowed = members if spec.allowed_nodes is None else spec.allowed_nodes & members
    return PodSpec(
        name=spec.name,
        gpu_milli=spec.gpu_milli,
        cpu_milli=spec.cpu_milli,
        mem_bytes=spec.mem_bytes,
        status=spec.status,
        node=spec.node,
        gpu_index=spec.gpu_index,
        task_priority=spec.task_priority,
        allowed_nodes=allowed,
        other=spec.other,
    )


def _place(session: Session, job: Job, chunk: Sequence[Pod], exclude: int, members: frozenset[str] | None) -> bool:
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
        spec = pod.spec if members is None else _within(pod.spec, members)
        seat = cluster.find(spec, True, held, exclude, gang_gpus)
        if seat is None and cluster.releasing:
            seat = cluster.find(spec, False, held, exclude, gang_gpus)
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
    shape = tuple(p.shape for p in chunk)
    # a gang bound to one clique may be held to the clique it is in: its failure tells nothing of another's
    return (*shape, ("one clique", chunk[0].job.index)) if chunk and chunk[0].job.spec.one_clique else shape
