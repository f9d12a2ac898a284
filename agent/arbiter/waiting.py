"""Why a gang still waits after a cycle, in words for an Event: pure, from the snapshot and the decisions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agent.arbiter.core.cycle import CycleResult, PodDecision
from agent.arbiter.core.model import MILLI, UNLIMITED, JobSpec, PodSpec, QueueSpec, Snapshot
from agent.arbiter.fit_error import NO_VICTIMS, NOT_HELPFUL, fit_error, preemption

NO_RESERVATIONS = "serve no reservations"  # a node whose agent runs without --reservation-addr (World.unserved)


def wait_reasons(
    snapshot: Snapshot, result: CycleResult, unserved: Mapping[str, tuple[int, str]] | None = None
) -> dict[str, str]:
    """job name -> reason, for every job with pods still pending (or pipelined) after the cycle. `unserved`:
    the nodes that publish GPUs the arbiter does not place on -> (their GPUs, why; World.unserved): a gang that
    does not fit is told of them, since they, not the cluster's size, may be what it waits for."""
    queues = {q.name: q for q in snapshot.queues}
    used: dict[str, int] = {}
    for job in snapshot.jobs:
        for pod in job.pods:
            d = result.pods[pod.name]
            if d.node is not None:
                used[d.node] = used.get(d.node, 0) + pod.gpu_milli
    free = {n.name: n.gpus * MILLI - used.get(n.name, 0) for n in snapshot.nodes}
    capacity = {n.name: n.gpus * MILLI for n in snapshot.nodes}
    cliques = {n.name: n.clique for n in snapshot.nodes if n.clique is not None}
    rooms = _Rooms(free, capacity)
    out: dict[str, str] = {}
    for job in snapshot.jobs:
        decisions = [result.pods[p.name] for p in job.pods]
        if any(d.outcome == "pending" for d in decisions) or len(job.pods) < job.min_member:
            out[job.name] = _reason(job, decisions, queues, result, rooms, cliques=cliques, unserved=unserved or {})
            if unserved and out[job.name].startswith("no fit") and not job.one_clique:  # it counts them itself
                out[job.name] = _left_out(unserved, out[job.name], placed_on=len(capacity))
    return out


def _left_out(unserved: Mapping[str, tuple[int, str]], reason: str, *, placed_on: int) -> str:
    """The reason, led (when the arbiter places on no node at all) or followed by the nodes left out, by cause:
    "2 node(s) with 4 GPUs serve no reservations (their node agents run without --reservation-addr...)"."""
    causes: dict[str, list[str]] = {}
    for node in sorted(unserved):
        causes.setdefault(unserved[node][1], []).append(node)
    told = []
    for why, nodes in causes.items():
        gpus = sum(unserved[n][0] for n in nodes)
        names = ", ".join(nodes[:3]) + (f" and {len(nodes) - 3} more" if len(nodes) > 3 else "")
        hint = (
            " (their node agents run without --reservation-addr, which the arbiter overlay sets; to leave the "
            "arbiter, run gpu-dra-agent arbiter --uninstall)"
            if why == NO_RESERVATIONS
            else ""
        )
        told.append(f"{len(nodes)} node(s) with {gpus} GPUs {why}{hint}: {names}")
    if not placed_on:
        return f"no node the arbiter may place on: {'; '.join(told)}"
    return f"{reason}; left out, {'; '.join(told)}"


class _Rooms:
    """The GPUs of a set of nodes (None: all of them) in milli-GPUs, summed once per set: the pods of a cluster
    share a few sets (agent.arbiter.node_rules hands equal rules one frozenset), and scanning every node for each
    waiting gang cost more than the rest of the reasons together."""

    def __init__(self, free: Mapping[str, int], capacity: Mapping[str, int]) -> None:
        self.free, self.capacity = free, capacity
        self._seen: dict[frozenset[str] | None, tuple[int, int, int, int, int]] = {}

    def of(self, nodes: frozenset[str] | None) -> tuple[int, int, int, int, int]:
        """(nodes, GPUs, most GPUs on one, GPUs free, most free on one) of `nodes` among the snapshot's."""
        known = self._seen.get(nodes)
        if known is None:
            names = self.capacity.keys() if nodes is None else [n for n in self.capacity if n in nodes]
            capacity, free = [self.capacity[n] for n in names], [self.free[n] for n in names]
            known = (len(capacity), sum(capacity), max(capacity, default=0), sum(free), max(free, default=0))
            self._seen[nodes] = known
        return known


def _reason(
    job: JobSpec,
    decisions: Sequence[PodDecision],
    queues: Mapping[str, QueueSpec],
    result: CycleResult,
    rooms: _Rooms,
    *,
    cliques: Mapping[str, str],
    unserved: Mapping[str, tuple[int, str]],
) -> str:
    if any(d.action == "pipeline" for d in decisions):
        return "waiting for evicted pods to release their devices (reclaim or preemption under way)"
    if len(job.pods) < job.min_member:
        return f"waiting for {job.min_member - len(job.pods)} more pod(s) of the gang (minCount {job.min_member})"
    want = sum(p.gpu_milli for p, d in zip(job.pods, decisions, strict=True) if d.outcome == "pending")
    q = queues.get(job.queue)
    while q is not None:
        held = result.allocated.get(q.name, (0.0, 0.0, 0.0))[0]
        limit, quota = q.terms[0].limit, q.terms[0].quota
        if limit != UNLIMITED and held + want > limit:
            return (
                f"over limit: queue {q.name} holds {held / MILLI:g} GPUs, its limit is {limit / MILLI:g}, "
                f"the gang needs {want / MILLI:g} more"
            )
        if not job.preemptible and quota != UNLIMITED and held + want > quota:
            return (
                f"over quota: a non-preemptible gang may only use queue {q.name}'s quota of "
                f"{quota / MILLI:g} GPUs ({held / MILLI:g} in use)"
            )
        q = queues.get(q.parent) if q.parent else None
    waiting = [p for p, d in zip(job.pods, decisions, strict=True) if d.outcome == "pending"]
    pending = [p.gpu_milli for p in waiting]
    if job.one_clique:
        return _no_clique(waiting, want, cliques, free=rooms.free, capacity=rooms.capacity, unserved=unserved)
    where, whole = "the cluster has", "the whole cluster has"
    nodes: frozenset[str] | None = None
    if waiting and all(p.allowed_nodes is not None for p in waiting):  # their affinity and tolerations narrow it
        sets = {p.allowed_nodes or frozenset() for p in waiting}
        nodes = sets.pop() if len(sets) == 1 else frozenset[str]().union(*sets)
        where, whole = "the nodes its pods may run on have", "those nodes have"
    count, total, most, free, most_free = rooms.of(nodes)
    largest = max(pending, default=0)
    text = (
        f"no fit: the gang needs {want / MILLI:g} GPUs in {len(pending)} pod(s), up to {largest / MILLI:g} "
        f"on one node; {where} {total / MILLI:g} GPUs on {count} node(s), at most "
        f"{most / MILLI:g} on one; {free / MILLI:g} free, at most "
        f"{most_free / MILLI:g} on one"
    )
    if want > total:
        return f"{text}: the gang asks for more than {whole}"
    if largest > most:
        return f"{text}: a pod asks for more GPUs than any node has"
    if want > free:
        return f"{text}: the rest is held by running pods"
    return f"{text}: its pods do not fit the free GPUs, CPU and memory of any node"


def _no_clique(
    waiting: Sequence[PodSpec],
    want: int,
    cliques: Mapping[str, str],
    *,
    free: Mapping[str, int],
    capacity: Mapping[str, int],
    unserved: Mapping[str, tuple[int, str]],
) -> str:
    """Why a gang sharing a ComputeDomain does not fit (it needs one clique, and none has the room), as
    kube-scheduler says why no node takes a pod (agent.arbiter.fit_error): every node counted once under its
    cause, the clique sizes it was weighed against in the words. kube-scheduler's DynamicResources plugin would
    say "cannot allocate all claims" for each; the cause says what would have to change. Where evicting running
    pods could make room (a clique large enough, its GPUs held), the arbiter found no victims, and says so as
    kube-scheduler's preemption does."""
    allowed: set[str] | None = None
    if waiting and all(p.allowed_nodes is not None for p in waiting):
        allowed = set().union(*(p.allowed_nodes or () for p in waiting))
    members: dict[str, list[str]] = {}
    for node, clique in cliques.items():
        if node in capacity and (allowed is None or node in allowed):
            members.setdefault(clique, []).append(node)
    size = {c: sum(capacity[n] for n in nodes) for c, nodes in members.items()}
    room = {c: sum(free[n] for n in nodes) for c, nodes in members.items()}
    largest = max(size.values(), default=0)
    freest = max((room[c] for c in members if size[c] >= want), default=0)
    need = f"{want / MILLI:g}"
    causes: dict[str, str] = {}  # node -> why it cannot take the gang
    held: set[str] = set()  # nodes where evicting could make room
    for node in capacity:
        home = cliques.get(node)
        if allowed is not None and node not in allowed:
            causes[node] = "node(s) didn't match the pods' node affinity, selector or tolerations"
        elif home is None:
            causes[node] = "node(s) offer no IMEX channel (in no complete, undegraded NVLink fabric clique)"
        elif size[home] < want:
            causes[node] = (
                f"node(s) in a clique too small for the gang's {need} GPUs (the largest has {largest / MILLI:g})"
            )
        elif room[home] < want:
            causes[node] = f"node(s) in a clique without {need} free GPUs (the freest has {freest / MILLI:g} free)"
            held.add(node)
        else:
            causes[node] = "node(s) in a clique whose free GPUs, CPU and memory do not fit the gang's pods"
    for node, (_gpus, why) in unserved.items():
        causes[node] = f"node(s) {why}"
    counts: dict[str, int] = {}
    for why in causes.values():
        counts[why] = counts.get(why, 0) + 1
    post = preemption(len(causes), {NO_VICTIMS: len(held), NOT_HELPFUL: len(causes) - len(held)}) if held else ""
    head = f"no fit in one NVLink clique for the {len(waiting)} pod(s) of a ComputeDomain needing {need} GPUs"
    return f"{head}: {fit_error(len(causes), counts, post)}"
