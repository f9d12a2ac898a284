"""What the API says, as the arbiter core's snapshot: pure, from the informers' objects (API JSON dicts).

- Queues: our `Queue` CRD (KAI v2 fields): GPU quota in devices, CPU in millicores, memory in MB (10^6 B).
- Gangs: a `scheduling.k8s.io/v1beta1` PodGroup (pods join it with `spec.schedulingGroup.podGroupName`;
  `spec.schedulingPolicy.gang.minCount`), or a pod alone. The queue label sits on the pod or its PodGroup.
- A pod waits (Pending) while it carries our scheduling gate; it holds devices (Running on its node) once its
  claims are allocated; it is Releasing while it terminates with claims still allocated.
- Nodes: those whose agent advertises a reservation address and its certificate's fingerprint (without it no
  channel can be pinned, so a reserve there could only fail); GPUs are the `type=gpu` devices of our driver's
  newest pool generation, less devices held by claims no arbiter pod accounts for (other schedulers' pods).
- The arbiter is the only allocator of the driver's devices (agent.arbiter.fence): a gated pod that names no
  queue waits in the default queue, and so does an ungated, unbound pod whose claim of our classes is not
  allocated (created before the fence, or ungated by hand; kube-scheduler cannot allocate it). A gated pod
  with neither a queue nor a claim of ours is released: its gate removed, nothing allocated.
  A device in two claims (however it came about) counts as used once and is reported in `World.doubles`.
- An admitted pod kube-scheduler will not bind to the node the arbiter picked (a rule the arbiter does not read,
  such as pod anti-affinity) is reported in `World.unbindable`, in kube-scheduler's words.

A gang whose pods cannot be weighed yet (claims not created, a queue missing, a request the arbiter does not
handle) is left out of the snapshot, with the reason in `World.waiting`. An object the arbiter cannot read (an
invalid Queue or PodGroup, a malformed pod or claim: agent.arbiter.validity) is left out too, in
`World.invalid`, and never stops the cycle.

`build_world` runs in phases, each handing its data to the next: the objects read and indexed, the nodes the
arbiter serves, the pods grouped into gangs, the served nodes' room, the gangs weighed as the core's jobs.
What an object says is agent.objects.read's; a claim's reservation request is agent.objects.write's.
"""

from __future__ import annotations

import functools
import itertools
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agent.allocation.allocator import Claim
from agent.arbiter import domains
from agent.arbiter.core.model import (
    MILLI,
    NON_PREEMPTIBLE_PRIORITY,
    JobSpec,
    NodeSpec,
    PodSpec,
    PodStatus,
    QueueSpec,
    Snapshot,
)
from agent.arbiter.node_rules import NodeRules, rules_key
from agent.arbiter.validity import Invalid, pod_group_problem, valid_queues
from agent.arbiter.waiting import NO_RESERVATIONS
from agent.devices.shares import Capacity
from agent.jsontypes import Json
from agent.names import (
    ADDRESS_ANNOTATION,
    ADMITTED_ANNOTATION,
    DEFAULT_QUEUE,
    FINGERPRINT_ANNOTATION,
    GPU_CLASS,
    MIG_CLASS,
    QUEUE_LABEL,
)
from agent.objects.read import (
    EXTENDED_RESOURCE,
    Choice,
    ShareDevices,
    add_amounts,
    allocatable,
    allocated_devices,
    allocated_node,
    allocated_shares,
    allocation_results,
    asks_extended_gpus,
    awaits_placement,
    choices,
    claim_is_ours,
    claim_names,
    claim_requests,
    device_type,
    is_allocated,
    is_gated,
    memo,
    meta,
    pod_key,
    pod_requests,
    pool_of,
    published_devices,
    quantity,
    share_devices,
    share_gpus,
    wants_our_devices,
)
from agent.objects.write import Unsupported, reservation_claim
from agent.times import parse_rfc3339


def requested_gpus(claim: Claim) -> float:
    """GPUs a claim asks for: a share its fraction, else its devices."""
    return sum(r.count if r.gpu_milli is None else r.gpu_milli / MILLI for r in claim.requests)


def device_gpus(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[tuple[str, str], float]:
    """(pool, device) -> how many GPUs the device is worth in queue accounting: a whole GPU 1, a MIG device
    the share of its parent GPU's memory it has (a 1g.10gb of an 80 GB H100: 1/8)."""
    gpu_memory: dict[str, float] = {}
    migs: list[tuple[tuple[str, str], str, float]] = []
    out: dict[tuple[str, str], float] = {}
    for _spec, key, d in published_devices(slices, driver):
        attrs = d.get("attributes") or {}
        kind = device_type(d)
        memory = quantity(((d.get("capacity") or {}).get("memory") or {}).get("value", "0"))
        if kind == "gpu":
            out[key] = 1.0
            uuid = (attrs.get("uuid") or {}).get("string")
            if uuid and memory:
                gpu_memory[str(uuid)] = memory
        elif kind == "mig":
            migs.append((key, str((attrs.get("parentUUID") or {}).get("string")), memory))
    for key, parent, memory in migs:
        whole = gpu_memory.get(parent)
        out[key] = min(1.0, memory / whole) if whole and memory else 1.0
    return out


def claim_gpus(
    claim: Mapping[str, Any],
    driver: str,
    worth: Mapping[tuple[str, str], float],
    capacities: Mapping[tuple[str, str], Mapping[str, float]] | None = None,
    share_devices: ShareDevices | None = None,
    *,
    choice: Choice | None = None,
) -> float:
    """GPUs a claim counts toward its queue: once allocated, what was allocated (a firstAvailable claim its
    chosen subrequest, a MIG device its share of a GPU, a consumable-capacity share the part of the GPU it
    consumed: nine 8Gi shares of a 79.6 GiB H100 are 72/79.6 of a GPU); before, what it asks for
    (firstAvailable: its first choice; unknown devices as whole GPUs; a share the part it would take of the
    shareable GPU it takes most of)."""
    if is_allocated(claim):
        total = 0.0
        for r in allocation_results(claim):
            if r.get("driver") != driver:
                continue
            key = (str(r.get("pool")), str(r.get("device")))
            if r.get("shareID"):
                total += share_gpus(r.get("consumedCapacity") or {}, (capacities or {}).get(key))
            else:
                total += worth.get(key, 1.0)
        return total
    if share_devices or choice:  # what a share would take depends on the devices published now
        return requested_gpus(reservation_claim(claim, (share_devices or {}).values(), choice))
    return _asked_gpus(claim)


Room = Sequence[tuple[float, int]]  # each node a pod may run on: (whole GPUs, MIG devices) it has for a claim


def first_available(claim: Mapping[str, Any]) -> bool:
    """Whether the claim has a firstAvailable request (`choose` plans it with one of its subrequests)."""
    return any(r.get("exactly") is None and r.get("firstAvailable") for r in claim_requests(claim))


def choose(claim: Mapping[str, Any], now: Room, ever: Room) -> Choice | None:
    """The subrequests a firstAvailable claim is planned with (None: it has no firstAvailable request). As
    kube-scheduler: on a node the first combination that fits wins, and it prefers the node where an earlier
    one fits (its DynamicResources Score). So the first combination that fits some node's free devices `now`;
    if none does, the first that fits some node at all (`ever`: its devices when empty), which the gang then
    waits or reclaims for; if none ever fits, the first. Whole GPUs and MIG devices are counted; selectors are
    the node's to check at Reserve."""
    if not first_available(claim):
        return None
    first: Choice | None = None
    asks: list[tuple[Choice, float, int]] = []
    for choice in choices(claim):
        try:
            wanted = reservation_claim(claim, (), choice)
        except Unsupported:
            continue
        first = choice if first is None else first
        mig = sum(r.count for r in wanted.requests if r.device_class == MIG_CLASS)
        asks.append((choice, requested_gpus(wanted) - mig, mig))
    for room in (now, ever):
        for choice, gpus, mig in asks:
            if any(gpus <= free_gpus + 1e-9 and mig <= free_mig for free_gpus, free_mig in room):
                return choice
    return first


def _asked_gpus(claim: Mapping[str, Any]) -> float:
    return memo("asked", claim, lambda c: requested_gpus(reservation_claim(c, ())))


@dataclass(frozen=True, slots=True)
class _PodFacts:
    """What the snapshot reads from a pod alone."""

    names: tuple[str, ...]  # its ResourceClaims
    missing: tuple[str, ...]  # template claims not generated yet
    gated: bool  # by the arbiter
    extended: bool  # asks for nvidia.com/gpu as an extended resource
    cpu: float  # milli-CPUs it asks of its node (pod_requests)
    mem: float  # bytes
    other: dict[str, float]  # the rest it asks of its node: pods, ephemeral-storage, hugepages, extended resources
    born: float | None  # creationTimestamp
    node_rules: str  # node_rules.rules_key


def _read_facts(pod: Mapping[str, Any]) -> _PodFacts:
    names, missing = claim_names(pod)
    asked = pod_requests(pod)
    other = {resource: amount for resource, amount in asked.items() if resource not in ("cpu", "memory")}
    return _PodFacts(
        tuple(names),
        tuple(missing),
        is_gated(pod),
        asks_extended_gpus(pod),
        asked.get("cpu", 0.0),
        asked.get("memory", 0.0),
        other,
        parse_rfc3339(meta(pod).get("creationTimestamp")),
        rules_key(pod),
    )


def _facts(pod: Mapping[str, Any]) -> _PodFacts:
    return memo("pod", pod, _read_facts)


@dataclass
class Member:
    """One pod of a gang as the controller acts on it."""

    key: str  # namespace/name, the core's pod name
    pod: Json
    claims: list[Json]  # its ResourceClaims, in pod order
    node: str | None = None  # where it holds devices (running or releasing)
    # claim name -> the firstAvailable subrequests it is planned, reserved and allocated with (choose)
    choices: dict[str, Choice] = field(default_factory=dict)


@dataclass
class Gang:
    name: str  # the core's job name
    namespace: str
    queue: str
    pod_group: str | None
    min_member: int
    members: dict[str, Member] = field(default_factory=dict)


@dataclass
class World:
    snapshot: Snapshot
    gangs: dict[str, Gang]  # by job name
    members: dict[str, Member]  # by pod key
    waiting: dict[str, str]  # job name -> why its gang is not weighed this cycle
    addresses: dict[str, str]  # node -> reservation address
    queue_names: list[str]
    invalid: dict[str, Invalid] = field(default_factory=dict)  # left out of the snapshot ("Kind ns/name")
    release: list[Json] = field(default_factory=list)  # gated pods that are not the arbiter's: ungate as they are
    doubles: dict[tuple[str, str], list[str]] = field(default_factory=dict)  # (pool, device) in 2+ claims -> keys
    shareable: dict[tuple[str, str], dict[str, Capacity]] = field(default_factory=dict)  # share_devices
    unbindable: dict[str, Unbindable] = field(default_factory=dict)  # by pod key
    # nodes that publish GPUs the arbiter does not place on -> (their GPUs, why: agent.arbiter.waiting says it)
    unserved: dict[str, tuple[int, str]] = field(default_factory=dict)
    weighed: dict[str, float] = field(default_factory=dict)  # waiting job -> first seen waiting (build_world)
    # parent queue -> its pending pods: a child queue made it a parent, and only leaf queues take pods
    stranded: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Unbindable:
    """An admitted pod kube-scheduler has found it cannot bind (its PodScheduled condition False, reason
    Unschedulable): its affinity is narrowed to `node`, where its claims are allocated, so it can go nowhere else."""

    node: str
    message: str  # kube-scheduler's: "0/4 nodes are available: 1 node(s) didn't match pod anti-affinity rules, ..."
    since: float | None  # when kube-scheduler first said so


def unbindable(pod: Json, node: str) -> Unbindable | None:
    """The pod's refusal by kube-scheduler, if an admitted, unbound pod has one."""
    if (pod.get("spec") or {}).get("nodeName") or ADMITTED_ANNOTATION not in (meta(pod).get("annotations") or {}):
        return None
    for c in (pod.get("status") or {}).get("conditions") or ():
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return Unbindable(node, str(c.get("message") or ""), parse_rfc3339(c.get("lastTransitionTime")))
    return None


def _newest_generations(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[str, int]:
    """pool -> the newest generation `driver`'s slices publish of it."""
    newest: dict[str, int] = {}
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") == driver:
            name, generation = pool_of(spec)
            newest[name] = max(newest.get(name, 0), generation)
    return newest


def _pool_devices(slices: Sequence[Mapping[str, Any]], driver: str) -> dict[str, set[str]]:
    """node -> names of its whole-GPU devices in the newest generation of its pool."""
    newest = _newest_generations(slices, driver)
    out: dict[str, set[str]] = {}
    for spec, (pool, device), d in published_devices(slices, driver):
        if pool_of(spec)[1] == newest[pool] and spec.get("nodeName") and device_type(d) == "gpu":
            out.setdefault(str(spec["nodeName"]), set()).add(device)
    return out


def _device_room(
    slices: Sequence[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]], driver: str, nodes: Iterable[str]
) -> dict[str, tuple[tuple[float, int], tuple[float, int]]]:
    """node -> ((whole GPUs, MIG devices) no claim holds, (whole GPUs, MIG devices) published), of the newest
    generation of each node's pool."""
    newest = _newest_generations(slices, driver)
    held = {key for c in claims if is_allocated(c) for key in allocated_devices(c, driver)}
    out = {n: [0, 0, 0, 0] for n in nodes}  # free GPUs, free MIG, GPUs, MIG
    for spec, key, d in published_devices(slices, driver):
        counts = out.get(str(spec.get("nodeName")))
        kind = device_type(d)
        if counts is None or pool_of(spec)[1] != newest[key[0]] or kind not in ("gpu", "mig"):
            continue
        column = 0 if kind == "gpu" else 1
        counts[column + 2] += 1
        if key not in held:
            counts[column] += 1
    return {n: ((float(c[0]), c[1]), (float(c[2]), c[3])) for n, c in out.items()}


@functools.lru_cache(maxsize=65536)  # a node's device names, sorted again every snapshot
def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """gpu-2 before gpu-10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", name) if p)


def _share_index(
    claims: Sequence[Mapping[str, Any]], driver: str, node: str, gpu_index: Mapping[str, Mapping[str, int]]
) -> int | None:
    """The core's index of the one GPU a pod's claims hold shares of, when that is all they hold there."""
    shared = {device for c in claims for pool, device, _ in allocated_shares(c, driver) if pool == node}
    whole = [d for c in claims for d in allocated_devices(c, driver, shares=False)]
    if len(shared) != 1 or whole:
        return None
    return gpu_index.get(node, {}).get(next(iter(shared)))


def _managed(node: Json, devices: Mapping[str, set[str]]) -> bool:
    """A node the arbiter places on: ready and schedulable, its agent's address and fingerprint annotated, its
    GPUs published."""
    annotations = meta(node).get("annotations") or {}
    return bool(
        annotations.get(ADDRESS_ANNOTATION)
        and annotations.get(FINGERPRINT_ANNOTATION)
        and str(meta(node).get("name")) in devices
        and _node_ready(node)
    )


def _unserved(node: Json) -> str:
    """Why the arbiter does not place on a node that publishes GPUs (one of waiting.py's causes)."""
    annotations = meta(node).get("annotations") or {}
    if not annotations.get(ADDRESS_ANNOTATION):
        return NO_RESERVATIONS
    if not annotations.get(FINGERPRINT_ANNOTATION):
        return "advertise no reservation certificate"
    return "are cordoned" if (node.get("spec") or {}).get("unschedulable") else "are not Ready"


def _node_ready(node: Mapping[str, Any]) -> bool:
    if (node.get("spec") or {}).get("unschedulable"):
        return False
    for c in (node.get("status") or {}).get("conditions") or ():
        if c.get("type") == "Ready":
            return bool(c.get("status") == "True")
    return True  # no conditions reported (a test cluster): taken as ready


@dataclass
class _Pod:
    job: str
    namespace: str
    group_name: str | None
    group: Json | None
    queue: str
    found: list[Json | None]  # its ResourceClaims (facts.names), None where not found
    status: PodStatus | None  # None: gone for the arbiter (terminated, holding nothing)
    node: str | None
    facts: _PodFacts


RELEASE = "release"  # _read_pod: a gated pod that is not the arbiter's, to be ungated as it is


def _read_pod(
    pod: Json,
    groups: Mapping[str, Json],
    claims: Mapping[str, Json],
    default_queue: str | None,
    *,
    landing: bool = False,
) -> _Pod | str | None:
    """An arbiter pod as the snapshot sees it; None for a pod that is not the arbiter's (no queue, or ungated and
    holding nothing: kube-scheduler's); RELEASE for a gated one that is not (its claims are other drivers').
    `landing`: a commit of ours placed it (the caller asks only when the plain reading is None), so ungated and
    holding nothing it reads as Pending, placed by the caller where the commit sends it, not as kube-scheduler's."""
    m = meta(pod)
    spec = pod.get("spec") or {}
    ns = str(m.get("namespace"))
    group_name = (spec.get("schedulingGroup") or {}).get("podGroupName")
    group = groups.get(f"{ns}/{group_name}") if group_name else None
    queue = (m.get("labels") or {}).get(QUEUE_LABEL) or meta(group or {}).get("labels", {}).get(QUEUE_LABEL)
    facts = _facts(pod)
    found = [claims.get(f"{ns}/{n}") for n in facts.names]
    gated = facts.gated
    deleting = bool(m.get("deletionTimestamp"))
    phase = (pod.get("status") or {}).get("phase")
    # ungated, unbound, with a claim of ours no one allocated: kube-scheduler cannot (the fence); we do
    caught = not gated and awaits_placement(pod) and wants_our_devices(found)
    if not queue and default_queue:
        if (
            gated
            and not facts.missing
            and None not in found
            and not any(claim_is_ours(c) for c in found if c)
            and not facts.extended
            and not deleting
        ):
            return RELEASE  # gated by the admission policy for claims that are not ours
        if gated or caught or ADMITTED_ANNOTATION in (m.get("annotations") or {}):
            queue = default_queue
    if not queue:
        return None
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise ValueError(f"spec.priority must be an integer, not {priority!r}")
    job = f"{ns}/{group_name}" if group_name else f"{ns}/pod/{m.get('name')}"
    held = [c for c in found if c is not None and is_allocated(c)]
    node = spec.get("nodeName") or next((allocated_node(c) for c in held if allocated_node(c)), None)
    status: PodStatus | None
    if deleting or phase in ("Succeeded", "Failed"):
        status = "Releasing" if held and node is not None else None
    elif gated or caught or landing:
        status = "Pending"
    elif held and node is not None:
        status = "Running"
    else:
        return None
    return _Pod(job, ns, group_name, group, str(queue), found, status, node, facts)


@dataclass(slots=True)
class _PodRead:
    """A pod's reading (_read_pod), with the objects it was read from: valid while each is the same object."""

    pod: Json
    group_key: str | None
    group: Json | None
    claim_keys: tuple[str, ...]
    claims: tuple[Json | None, ...]
    default_queue: str | None
    read: _Pod | str | None


@dataclass(slots=True)
class _JobRead:
    """A gang weighed as a job (_weigh_gangs), with everything it was weighed from."""

    inputs: tuple[Any, ...]
    objects: tuple[Any, ...]  # the objects whose ids `inputs` holds, kept so that no id is reused meanwhile
    # the Gang it was weighed as: the grouping keeps a gang none of whose pods, claims, PodGroup, node rules or
    # commit changed, so the same Gang (with the same served nodes) means the same `inputs` but for `context`
    gang: Gang
    context: tuple[Any, ...]  # _job_context
    job: JobSpec
    exact_before: float  # its queue's running sum (exact) before it
    exact_after: float  # and after it
    # a fraction of a GPU among its pods: their milli-GPUs round against the running sum, so it is weighed from
    # that sum's value; a gang of whole GPUs, from whether the sum is whole (its pods' milli-GPUs are then exact)
    fractional: bool
    claims: tuple[str, ...]  # the claims it counted
    first_seen: float | None


class WorldCache:
    """What the last snapshot read from objects that have not changed since, for the next one: the informers
    replace an object when it changes, so an object that is still the same one (identity) reads the same. A pod
    is read again only when it, its PodGroup or one of its claims is a new object; a gang is weighed again only
    when something it was weighed from changed (its pods, claims, PodGroup, statuses and nodes, its queue's
    running sum before it, the published devices). Gangs whose weighing reads the cluster around them (a
    firstAvailable claim, a share of a GPU, a claim shared with another gang, an unreadable claim, no creation
    time) are weighed afresh every time. The pods' grouping into gangs is kept too (`grouping`, _Grouping): only
    the pods that changed, and their jobs, are grouped again. A snapshot built with a cache is the one built
    without (tests/unit/test_arbiter_incremental.py)."""

    def __init__(self) -> None:
        self.pods: dict[str, _PodRead] = {}
        self.jobs: dict[str, _JobRead] = {}
        self.slices_read: list[Json] = []  # the slices `pools`, `devices` and `jobs` were read from
        self.pools: dict[str, set[str]] | None = None  # _pool_devices
        self.devices: (
            tuple[
                dict[tuple[str, str], float],
                dict[tuple[str, str], dict[str, Capacity]],
                dict[tuple[str, str], dict[str, float]],
            ]
            | None
        ) = None
        self.grouping = _Grouping()
        self.served: frozenset[str] = frozenset()  # the served nodes the last snapshot weighed the gangs against
        self.pods_read = 0  # pods read afresh by the last snapshot (tests, the benchmark)
        self.jobs_weighed = 0  # gangs weighed afresh by the last snapshot

    def read_slices(self, slices: Sequence[Json]) -> None:
        """Forget what was read from the slices when any of them changed (every gang's weighing included)."""
        if not _same_objects(self.slices_read, slices):
            self.slices_read, self.pools, self.devices, self.jobs = list(slices), None, None, {}


def _same_objects(before: Sequence[Json], now: Sequence[Json]) -> bool:
    return len(before) == len(now) and all(a is b for a, b in zip(before, now, strict=True))


def _read_pod_cached(
    pod: Json,
    key: str,
    groups: Mapping[str, Json],
    claims: Mapping[str, Json],
    default_queue: str | None,
    *,
    cache: WorldCache | None,
    seen: dict[str, _PodRead],
) -> _Pod | str | None:
    """_read_pod, or what it read last time from the same objects; `key`: the pod's (pod_key)."""
    if cache is None:
        return _read_pod(pod, groups, claims, default_queue)
    hit = cache.pods.get(key)
    if (
        hit is not None
        and hit.pod is pod
        and hit.default_queue == default_queue
        and (hit.group_key is None or groups.get(hit.group_key) is hit.group)
        and all(claims.get(k) is c for k, c in zip(hit.claim_keys, hit.claims, strict=True))
    ):
        seen[key] = hit
        return hit.read
    read = _read_pod(pod, groups, claims, default_queue)  # raises for a malformed pod: nothing remembered
    ns = str(meta(pod).get("namespace"))
    group_name = ((pod.get("spec") or {}).get("schedulingGroup") or {}).get("podGroupName")
    group_key = f"{ns}/{group_name}" if group_name else None
    claim_keys = tuple(f"{ns}/{n}" for n in _facts(pod).names)
    seen[key] = _PodRead(
        pod,
        group_key,
        groups.get(group_key) if group_key else None,
        claim_keys,
        tuple(claims.get(k) for k in claim_keys),
        default_queue,
        read,
    )
    cache.pods_read += 1
    return read


# --- the snapshot, in phases: the objects read -> the nodes served -> the gangs -> the nodes' room -> the jobs ---


@dataclass
class _Objects:
    """The objects indexed, with what of them the arbiter cannot weigh."""

    slices: list[Json]
    claims: dict[str, Json]  # by namespace/name
    groups: dict[str, Json]  # PodGroups by namespace/name
    queues: list[QueueSpec]  # the valid ones, in input order
    bad_queues: dict[str, Invalid]  # by queue name
    bad_groups: dict[str, str]  # PodGroup key -> why it is invalid
    invalid: dict[str, Invalid]  # the Queues and PodGroups left out ("Kind ns/name")

    @functools.cached_property
    def by_queue(self) -> dict[str, QueueSpec]:
        return {q.name: q for q in self.queues}

    @functools.cached_property
    def children(self) -> dict[str, list[str]]:
        """Parent queue -> its child queues' names, sorted."""
        out: dict[str, list[str]] = {}
        for q in self.queues:
            if q.parent:
                out.setdefault(q.parent, []).append(q.name)
        return {parent: sorted(names) for parent, names in out.items()}


def _read_objects(
    claims: Iterable[Json], pod_groups: Iterable[Json], queues: Iterable[Json], slices: Iterable[Json]
) -> _Objects:
    slices = list(slices)  # read thrice: devices per node, what each device is worth, the shareable ones
    claims_by_key = {f"{meta(c).get('namespace')}/{meta(c).get('name')}": c for c in claims}
    groups = {f"{meta(g).get('namespace')}/{meta(g).get('name')}": g for g in pod_groups}
    queue_specs, bad_queues = valid_queues(queues)
    invalid = {bad.key: bad for bad in bad_queues.values()}
    bad_groups: dict[str, str] = {}
    for key, g in groups.items():
        problem = pod_group_problem(g)
        if problem is not None:
            bad = Invalid("PodGroup", g, f"invalid PodGroup: {problem}")
            invalid[bad.key] = bad
            bad_groups[key] = problem
    return _Objects(slices, claims_by_key, groups, queue_specs, bad_queues, bad_groups, invalid)


@dataclass
class _Served:
    """The nodes the arbiter places on: ready, their agent reachable, their GPUs published."""

    devices: dict[str, set[str]]  # node -> its whole GPUs (_pool_devices), served or not
    managed: list[Json]
    unserved: dict[str, tuple[int, str]]  # told to the gangs that wait for GPUs (waiting.py)


def _serve_nodes(
    nodes: Iterable[Json], slices: Sequence[Json], driver: str, cache: WorldCache | None = None
) -> _Served:
    if cache is not None and cache.pools is not None:  # read_slices: the slices are those it was read from
        devices = cache.pools
    else:
        devices = _pool_devices(slices, driver)
        if cache is not None:
            cache.pools = devices
    managed: list[Json] = []
    unserved: dict[str, tuple[int, str]] = {}
    for n in nodes:
        host = str(meta(n).get("name"))
        if _managed(n, devices):
            managed.append(n)
        elif host in devices:
            unserved[host] = (len(devices[host]), _unserved(n))
    return _Served(devices, managed, unserved)


@dataclass
class _Gangs:
    """The arbiter's pods in their gangs, and the pods around them."""

    gangs: dict[str, Gang] = field(default_factory=dict)
    members: dict[str, Member] = field(default_factory=dict)
    statuses: dict[str, PodStatus] = field(default_factory=dict)  # by pod key
    waiting: dict[str, str] = field(default_factory=dict)  # job -> why it is not weighed
    unweighed: set[str] = field(default_factory=set)  # gangs left out whole (their queue or PodGroup is bad)
    holding: dict[str, set[str]] = field(default_factory=dict)  # gang -> the claims its placed pods hold
    allowed: dict[str, frozenset[str]] = field(default_factory=dict)  # pending pod -> nodes its rules allow
    other_pods: list[Json] = field(default_factory=list)  # not the arbiter's
    release: list[Json] = field(default_factory=list)  # World.release
    flying: set[str] = field(default_factory=set)  # gangs with a commit under way
    refused: dict[str, Unbindable] = field(default_factory=dict)  # World.unbindable
    stranded: dict[str, int] = field(default_factory=dict)  # World.stranded
    invalid: dict[str, Invalid] = field(default_factory=dict)  # the pods the arbiter cannot read

    @functools.cached_property
    def left_out(self) -> set[str]:
        """The gangs left out of the snapshot: they hold their devices all the same, as others' claims."""
        return self.unweighed | {
            job for job in self.waiting if any(self.statuses[k] == "Pending" for k in self.gangs[job].members)
        }


@dataclass(slots=True)
class _PodPlace:
    """Where one pod goes in _Gangs: a member of its job (`read`), or `other` (not the arbiter's), `release`d, or
    `invalid`; or nowhere (gone for the arbiter). `seq`: its place in the informers' order."""

    seq: int
    key: str
    pod: Json
    read: _Pod | None = None
    flying: bool = False  # its gang's commit is under way
    other: bool = False
    release: bool = False
    invalid: Invalid | None = None
    # what its reading read besides the pod (WorldCache): its change places the pod again
    claim_keys: tuple[str, ...] = ()
    group_key: str | None = None


@dataclass(slots=True)
class _JobGroup:
    """One job's part of _Gangs, from its members in the informers' order."""

    first: int  # its first member's seq: the jobs' order
    gang: Gang
    statuses: dict[str, PodStatus]
    waiting: str | None
    unweighed: bool
    stranded: dict[str, int]  # parent queue -> its pending pods that name it
    holding: set[str] | None
    allowed: dict[str, frozenset[str]]
    refused: dict[str, Unbindable]
    flying: bool


@dataclass(frozen=True, slots=True)
class _Around:
    """What a pod's place, and its job's group, are read against besides the pods."""

    objects: _Objects
    rules: NodeRules
    default_queue: str | None
    in_flight: Mapping[str, str]
    refused_claims: Mapping[str, str]


def _place_pod(
    pod: Json, key: str, seq: int, around: _Around, *, cache: WorldCache | None, seen: dict[str, _PodRead]
) -> _PodPlace:
    objects, default_queue = around.objects, around.default_queue
    try:
        read = _read_pod_cached(pod, key, objects.groups, objects.claims, default_queue, cache=cache, seen=seen)
    except (AttributeError, TypeError, ValueError) as e:  # a malformed object: reported, never fatal
        return _PodPlace(seq, key, pod, invalid=Invalid("Pod", pod, f"the arbiter cannot read this pod: {e}"))
    if read == RELEASE:
        return _PodPlace(seq, key, pod, release=True)
    going = around.in_flight.get(key)
    if read is None and going is not None:
        # bound by our commit, its claims not yet shown allocated (the claim watch can trail the pod
        # watch): not a stranger's pod holding nothing, but one of ours, on its way to `going`
        read = _read_pod(pod, objects.groups, objects.claims, default_queue, landing=True)
    if not isinstance(read, _Pod):
        return _PodPlace(seq, key, pod, other=True)
    flying = going is not None and read.status == "Pending"
    if flying:
        read = replace(read, status="Running", node=going)
    if read.status is None:
        return _PodPlace(seq, key, pod)  # gone for the arbiter: holds nothing
    return _PodPlace(seq, key, pod, read, flying)


def _group_job(job: str, places: Sequence[_PodPlace], around: _Around) -> _JobGroup:
    """The job's part of _Gangs from its members in the informers' order (each pod read as _group_gangs always
    read it: its own queue and PodGroup checked, the gang made at its first pod)."""
    objects, rules, refused_claims = around.objects, around.rules, around.refused_claims
    gang: Gang | None = None
    waiting: str | None = None
    unweighed = False
    stranded: dict[str, int] = {}
    statuses: dict[str, PodStatus] = {}
    holding: set[str] | None = None
    allowed: dict[str, frozenset[str]] = {}
    refused: dict[str, Unbindable] = {}
    for place in places:
        read, pod = place.read, place.pod
        assert read is not None and read.status is not None
        key, ns, group_name, group, queue = place.key, read.namespace, read.group_name, read.group, read.queue
        name = meta(pod).get("name")
        if group_name and group is None and waiting is None:
            waiting = f"PodGroup {group_name} does not exist"
        if group_name and f"{ns}/{group_name}" in objects.bad_groups:
            waiting = f"PodGroup {group_name} is invalid: {objects.bad_groups[f'{ns}/{group_name}']}"
            unweighed = True
        if queue in objects.bad_queues:
            waiting = f"queue {queue} is left out: {objects.bad_queues[queue].reason}"
            unweighed = True
        elif queue not in objects.by_queue:
            waiting = f"queue {queue} does not exist"
            unweighed = True
        elif queue in objects.children:  # KAI skips such jobs too (JobsOrderByQueues: only leaf queues' jobs)
            waiting = (
                f"queue {queue} is a parent queue (of {', '.join(objects.children[queue])}); only leaf queues "
                f"take pods: the gang waits until it names a leaf queue or {queue} has no child queue again"
            )
            unweighed = True
            if read.status == "Pending":
                stranded[str(queue)] = stranded.get(str(queue), 0) + 1
        if read.status == "Pending":
            if read.facts.extended:
                waiting = (
                    f"{name} asks for {EXTENDED_RESOURCE} as an extended resource; the arbiter "
                    f"allocates GPUs only through ResourceClaims (class {GPU_CLASS})"
                )
            elif read.facts.missing and waiting is None:
                waiting = (
                    f"waiting for the ResourceClaims of {name} "
                    f"({', '.join(read.facts.missing)}) to be created from their templates"
                )
            elif any(c is None for c in read.found) and waiting is None:
                waiting = f"ResourceClaim of {name} not found"
            for c in read.found:
                problem = None if c is None else refused_claims.get(f"{ns}/{meta(c).get('name')}")
                if c is not None and problem is not None and waiting is None:  # the claim's error: it waits
                    waiting = f"ResourceClaim {meta(c).get('name')} of {name} was refused as written: {problem}"
            # only where kube-scheduler will bind it: the arbiter narrows the pod's affinity to the node it picks
            nodes_allowed, why = rules.allowed(pod, read.facts.node_rules)
            if nodes_allowed is not None:
                allowed[key] = nodes_allowed
            if why and waiting is None:
                waiting = f"no node may run {name}: {why}"
        if gang is None:
            min_count = 1
            if group is not None and not unweighed:  # a valid PodGroup (pod_group_problem)
                policy = (group.get("spec") or {}).get("schedulingPolicy") or {}
                min_count = int((policy.get("gang") or {}).get("minCount") or 1)
            gang = Gang(job, ns, str(queue), group_name, min_count)
        gang.members[key] = Member(
            key, pod, [c for c in read.found if c is not None], read.node if read.status != "Pending" else None
        )
        statuses[key] = read.status
        if read.status != "Pending":
            holding = holding if holding is not None else set()
            holding.update(f"{ns}/{n}" for n in read.facts.names)
            stuck = unbindable(pod, read.node) if read.status == "Running" and read.node else None
            if stuck is not None:
                refused[key] = stuck
    assert gang is not None
    flying = any(p.flying for p in places)
    return _JobGroup(places[0].seq, gang, statuses, waiting, unweighed, stranded, holding, allowed, refused, flying)


@dataclass(frozen=True, slots=True)
class _Changes:
    changed: dict[str, Json]  # pod key -> the new object
    gone: set[str]  # pod keys no longer held
    gone_ids: set[int]  # the ids of the objects no longer held (gone or replaced)
    stale: set[str]  # pods to place again: what they read changed (a claim, their PodGroup, a commit, a refusal)


class _Grouping:
    """The pods grouped into gangs, kept between snapshots (WorldCache.grouping): only the pods that changed (new
    objects, by identity), or whose claims, PodGroup, commit or refusal changed, are placed again, and only their
    jobs grouped again; the informers' order is kept by each pod's `seq` (a modified pod keeps its place, a new one
    comes last, as in the informer's store; any other order is grouped afresh). The managed nodes changed: the
    pending pods (their rules read against them). The queues or the default queue changed, or nothing kept:
    everything afresh."""

    def __init__(self) -> None:
        self.context: tuple[Any, ...] | None = None
        self.pods: list[Json] = []  # the pods last grouped, kept so that no id below is reused
        self.claims: Mapping[str, Json] = {}  # kept, as the pods are
        self.groups: Mapping[str, Json] = {}
        self.managed: list[Json] = []
        self.key_by_id: dict[int, str] = {}
        self.seq_by_id: dict[int, int] = {}
        self.claim_ids: dict[int, str] = {}
        self.group_ids: dict[int, str] = {}
        self.places: dict[str, _PodPlace] = {}
        self.by_job: dict[str, set[str]] = {}  # job -> its members' keys
        self.by_claim: dict[str, set[str]] = {}  # claim key -> the pods that name it
        self.by_group: dict[str, set[str]] = {}  # PodGroup key -> the pods that name it
        self.pending: set[str] = set()  # the pods whose node rules are read (against the managed nodes)
        self.jobs: dict[str, _JobGroup] = {}
        self.in_flight: dict[str, str] = {}
        self.refused: dict[str, str] = {}
        self.next_seq = 0

    def group(self, pods: list[Json], managed: list[Json], around: _Around, cache: WorldCache | None) -> _Gangs:
        """`managed`: the nodes `around.rules` were made from."""
        objects = around.objects
        context = (around.default_queue, objects.queues, {k: bad.reason for k, bad in objects.bad_queues.items()})
        claim_ids, group_ids = _keys_by_id(objects.claims), _keys_by_id(objects.groups)
        changes = None
        if cache is not None and context == self.context:
            nodes_changed = not _same_objects(self.managed, managed)
            changes = self._changes(pods, around, claim_ids, group_ids, nodes_changed=nodes_changed)
        if changes is None or not self._apply(changes, pods, around, cache):
            self._afresh(pods, around, cache)
        self.context = context if cache is not None else None
        self.pods, self.managed = pods, list(managed)
        self.claims, self.groups = objects.claims, objects.groups
        self.claim_ids, self.group_ids = claim_ids, group_ids
        self.in_flight, self.refused = dict(around.in_flight), dict(around.refused_claims)
        return self._assemble()

    def _afresh(self, pods: list[Json], around: _Around, cache: WorldCache | None) -> None:
        self.places, self.by_job, self.by_claim, self.by_group, self.pending = {}, {}, {}, {}, set()
        self.key_by_id, self.seq_by_id = {}, {}
        seen: dict[str, _PodRead] = {}
        for seq, pod in enumerate(pods):
            try:
                key = pod_key(pod)
            except (AttributeError, TypeError, ValueError) as e:  # no key: reported, and kept out of the cache
                bad = Invalid("Pod", pod, f"the arbiter cannot read this pod: {e}")
                self.places[f"#{seq}"] = _PodPlace(seq, f"#{seq}", pod, invalid=bad)
                continue
            self._remember(key, _place_pod(pod, key, seq, around, cache=cache, seen=seen), seen.get(key))
            self.key_by_id[id(pod)], self.seq_by_id[id(pod)] = key, seq
        self.next_seq = len(pods)
        if cache is not None:
            cache.pods = seen  # pods gone since are forgotten
        self.jobs = {}
        for job in self.by_job:
            self._regroup(job, around)

    def _changes(
        self,
        pods: list[Json],
        around: _Around,
        claim_ids: dict[int, str],
        group_ids: dict[int, str],
        *,
        nodes_changed: bool,
    ) -> _Changes | None:
        """What changed since the pods were last grouped; None when a new pod has no key (it is reported as
        invalid by grouping afresh)."""
        now = dict(zip(map(id, pods), pods, strict=True))
        changed: dict[str, Json] = {}
        for i in now.keys() - self.key_by_id.keys():
            try:
                changed[pod_key(now[i])] = now[i]
            except (AttributeError, TypeError, ValueError):
                return None
        gone_ids = self.key_by_id.keys() - now.keys()
        gone = {self.key_by_id[i] for i in gone_ids} - changed.keys()
        stale: set[str] = set()
        in_flight, refused_claims = around.in_flight, around.refused_claims
        for key in _changed_keys(claim_ids, self.claim_ids):
            stale |= self.by_claim.get(key, set())
        for key in _changed_keys(group_ids, self.group_ids):
            stale |= self.by_group.get(key, set())
        stale.update(key for key, _ in in_flight.items() ^ self.in_flight.items())
        for claim, _ in refused_claims.items() ^ self.refused.items():
            stale |= self.by_claim.get(claim, set())
        if nodes_changed:  # which nodes a pending pod's rules allow
            stale |= self.pending
        return _Changes(changed, gone, gone_ids, stale - gone - changed.keys())

    def _apply(self, changes: _Changes, pods: list[Json], around: _Around, cache: WorldCache | None) -> bool:
        """Place the changed pods again and group their jobs again; False (what is kept is then stale) when the
        informers' order is not the one kept (a pod deleted and made again under its name comes last)."""
        assert cache is not None
        jobs: set[str] = set()
        for key in changes.gone:
            jobs.add(self._forget(key))
            cache.pods.pop(key, None)
        for i in changes.gone_ids:
            del self.key_by_id[i], self.seq_by_id[i]
        for key in changes.changed.keys() | changes.stale:
            old = self.places.get(key)
            pod = changes.changed.get(key) or (old.pod if old is not None else None)
            if pod is None:
                continue  # a commit's pod the informers do not hold (yet, or any more)
            if old is not None:
                jobs.add(self._forget(key))
                seq = old.seq
            else:
                seq, self.next_seq = self.next_seq, self.next_seq + 1
            place = _place_pod(pod, key, seq, around, cache=cache, seen=cache.pods)
            self._remember(key, place, cache.pods.get(key))
            self.key_by_id[id(pod)], self.seq_by_id[id(pod)] = key, seq
            if place.read is not None:
                jobs.add(place.read.job)
        order = list(map(self.seq_by_id.__getitem__, map(id, pods)))
        if not all(map(operator.lt, order, itertools.islice(order, 1, None))):
            return False
        for job in jobs:
            self._regroup(job, around)
        return True

    def _remember(self, key: str, place: _PodPlace, reading: _PodRead | None) -> None:
        self.places[key] = place
        if reading is not None:
            place.claim_keys, place.group_key = reading.claim_keys, reading.group_key
        for claim in place.claim_keys:
            self.by_claim.setdefault(claim, set()).add(key)
        if place.group_key is not None:
            self.by_group.setdefault(place.group_key, set()).add(key)
        if place.read is not None:
            self.by_job.setdefault(place.read.job, set()).add(key)
            if place.read.status == "Pending":
                self.pending.add(key)

    def _forget(self, key: str) -> str:
        """Drop the pod's place; returns its job ("" for none)."""
        place = self.places.pop(key, None)
        if place is None:
            return ""
        for claim in place.claim_keys:
            _discard(self.by_claim, claim, key)
        if place.group_key is not None:
            _discard(self.by_group, place.group_key, key)
        if place.read is None:
            return ""
        _discard(self.by_job, place.read.job, key)
        self.pending.discard(key)
        return place.read.job

    def _regroup(self, job: str, around: _Around) -> None:
        keys = self.by_job.get(job)
        if not job or not keys:
            self.jobs.pop(job, None)
            return
        places = sorted((self.places[k] for k in keys), key=lambda p: p.seq)
        self.jobs[job] = _group_job(job, places, around)

    def _assemble(self) -> _Gangs:
        out = _Gangs()
        for job, group in sorted(self.jobs.items(), key=lambda item: item[1].first):
            out.gangs[job] = group.gang
            out.members.update(group.gang.members)
            out.statuses.update(group.statuses)
            if group.waiting is not None:
                out.waiting[job] = group.waiting
            if group.unweighed:
                out.unweighed.add(job)
            if group.holding is not None:
                out.holding[job] = group.holding
            out.allowed.update(group.allowed)
            out.refused.update(group.refused)
            for queue, count in group.stranded.items():
                out.stranded[queue] = out.stranded.get(queue, 0) + count
            if group.flying:
                out.flying.add(job)
        for place in sorted((p for p in self.places.values() if p.read is None), key=lambda p: p.seq):
            if place.invalid is not None:
                out.invalid[place.invalid.key] = place.invalid
            elif place.release:
                out.release.append(place.pod)
            elif place.other:
                out.other_pods.append(place.pod)
        return out


def _keys_by_id(objects: Mapping[str, Json]) -> dict[int, str]:
    """id -> key of each object (in C: no Python loop over them)."""
    return dict(zip(map(id, objects.values()), objects, strict=True))


def _changed_keys(now: Mapping[int, str], before: Mapping[int, str]) -> set[str]:
    """The keys whose object is new, replaced or gone between two _keys_by_id."""
    return {now[i] for i in now.keys() - before.keys()} | {before[i] for i in before.keys() - now.keys()}


def _discard(index: dict[str, set[str]], key: str, value: str) -> None:
    values = index.get(key)
    if values is not None:
        values.discard(value)
        if not values:
            del index[key]


def _group_gangs(
    pods: Iterable[Json],
    objects: _Objects,
    managed: list[Json],
    *,
    default_queue: str | None,
    in_flight: Mapping[str, str] | None,
    refused_claims: Mapping[str, str] | None,
    cache: WorldCache | None = None,
) -> _Gangs:
    around = _Around(objects, NodeRules(managed), default_queue, in_flight or {}, refused_claims or {})
    return (cache.grouping if cache is not None else _Grouping()).group(list(pods), managed, around, cache)


@dataclass
class _Nodes:
    """The served nodes as the core sees them."""

    specs: list[NodeSpec]
    addresses: dict[str, str]  # node -> reservation address
    doubles: dict[tuple[str, str], list[str]]  # World.doubles
    gpu_index: dict[str, dict[str, int]]  # node -> its GPUs nobody else holds -> the core's index

    @functools.cached_property
    def names(self) -> set[str]:
        return {s.name for s in self.specs}


def _with_channels(free: dict[str, float], offered: tuple[str, int] | None, held: int) -> dict[str, float]:
    """The node's other resources with its ComputeDomain channels free (a node that publishes none has none)."""
    if offered is not None:
        free[domains.CHANNEL_RESOURCE] = float(offered[1] - held)
    return free


def _weigh_nodes(objects: _Objects, served: _Served, found: _Gangs, driver: str) -> _Nodes:
    """What each served node has for the snapshot's pods: its GPUs less those held outside the snapshot, its
    CPU, memory and the rest less what pods outside the snapshot ask there."""
    devices, gangs, statuses, left_out = served.devices, found.gangs, found.statuses, found.left_out
    attributed = {c for job, held in found.holding.items() if job not in left_out for c in held}  # snapshot pods'
    allocated = [(key, c) for key, c in objects.claims.items() if is_allocated(c)]
    owners: dict[tuple[str, str], list[str]] = {}  # every device of ours allocated whole -> the claims holding it
    for key, c in allocated:
        for whole in allocated_devices(c, driver, shares=False):
            owners.setdefault(whole, []).append(key)
    # A device counts as used once, whoever holds it: held by a snapshot pod, it is in that pod's GPUs (twice if
    # two snapshot pods' claims hold it, so the node gets one back); otherwise it is taken from the node. A GPU
    # whose shares other claims hold is held once too.
    held_devices: dict[str, set[str]] = {}
    for key, c in allocated:
        if key in attributed:
            continue
        for pool, name in allocated_devices(c, driver):
            if pool in devices and not any(k in attributed for k in owners.get((pool, name), ())):
                held_devices.setdefault(pool, set()).add(name)
    counted_twice: dict[str, int] = {}  # node -> devices counted again in a second snapshot pod's GPUs
    for (pool, _device), keys in owners.items():
        ours = sum(1 for k in keys if k in attributed)
        if ours > 1:
            counted_twice[pool] = counted_twice.get(pool, 0) + ours - 1
    doubles = {device: sorted(keys) for device, keys in owners.items() if len(keys) > 1}
    # The core's GPU indices of each node: its GPUs nobody else holds, in name order. A running share is seated
    # on the GPU it really uses, so the arbiter's picture of a node is the node's (unseated, pods of different
    # sizes could be packed where they do not fit, and a whole-GPU pod would be planned onto a shared GPU).
    gpu_index = {
        node: {d: i for i, d in enumerate(sorted(names - held_devices.get(node, set()), key=_natural))}
        for node, names in devices.items()
    }
    # what each node's pods ask of it (pod_requests): outside the snapshot (other pods, the running pods of gangs
    # left out), taken from the node; inside it, loaded by the core
    outside: dict[str, dict[str, float]] = {}
    inside: dict[str, dict[str, float]] = {}
    placed = [
        ((p.get("spec") or {}).get("nodeName"), p, outside)
        for p in found.other_pods
        if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]
    placed += [
        (m.node, m.pod, outside if job in left_out else inside)
        for job, gang in gangs.items()
        for m in gang.members.values()
        if statuses[m.key] != "Pending"
    ]
    for node_name, pod, asked in placed:
        if node_name:
            facts = _facts(pod)
            on_node = asked.setdefault(node_name, {})
            add_amounts(on_node, {"cpu": facts.cpu, "memory": facts.mem, **facts.other})
    node_specs = []
    addresses: dict[str, str] = {}
    # ComputeDomain channels (agent.arbiter.domains): where published, the node's clique and its free channels
    channels = domains.offered(objects.slices)
    channels_held = domains.held(c for _, c in allocated) if channels else {}
    for n in served.managed:
        name = str(meta(n).get("name"))
        addresses[name] = str(meta(n)["annotations"][ADDRESS_ANNOTATION])
        free = allocatable(n)
        for resource, amount in outside.get(name, {}).items():
            free[resource] = free.get(resource, 0.0) - amount
        mine = inside.get(name, {})
        # never less CPU and memory than the snapshot's pods there ask: an over-committed node (its allocatable
        # shrank, a resize) is full, not a snapshot the cycle refuses
        cpu, mem = max(mine.get("cpu", 0.0), free.pop("cpu")), max(mine.get("memory", 0.0), free.pop("memory"))
        node_specs.append(
            NodeSpec(
                name=name,
                gpus=max(0, len(devices[name]) - len(held_devices.get(name, ())) + counted_twice.get(name, 0)),
                cpu_milli=cpu,
                mem_bytes=mem,
                other=_with_channels(free, channels.get(name), channels_held.get(name, 0)),
                clique=channels[name][0] if name in channels else None,
            )
        )
    return _Nodes(node_specs, addresses, doubles, gpu_index)


@dataclass
class _Jobs:
    """The gangs weighed, as the core's jobs, and what weighing them found."""

    jobs: list[JobSpec]
    shareable: dict[tuple[str, str], dict[str, Capacity]]  # World.shareable
    first_seen: dict[str, float]  # World.weighed
    waiting: dict[str, str]  # gangs with a claim the arbiter cannot reserve for: why
    invalid: dict[str, Invalid]  # the claims the arbiter cannot read


def _weigh_gangs(
    objects: _Objects,
    found: _Gangs,
    nodes: _Nodes,
    driver: str,
    *,
    now: float,
    weighed: Mapping[str, float] | None,
    cache: WorldCache | None = None,
) -> _Jobs:
    """Each gang not left out as a job: its pods' GPUs (a claim shared by pods counted once; a firstAvailable
    claim of a pending pod planned with the subrequests `choose` picks, recorded in Member.choices), CPU and
    memory, its priority and times."""
    slices, groups, statuses, allowed = objects.slices, objects.groups, found.statuses, found.allowed
    known_nodes, gpu_index = nodes.names, nodes.gpu_index
    jobs = []
    waiting: dict[str, str] = {}
    invalid: dict[str, Invalid] = {}
    # what the published devices are worth, and which are shareable: read again only when a slice changed
    if cache is not None and cache.devices is not None:  # read_slices: the slices are those it was read from
        worth, shareable, capacities = cache.devices
    else:
        worth = device_gpus(slices, driver)
        shareable = share_devices(slices, driver)
        capacities = {key: {name: float(c.value) for name, c in caps.items()} for key, caps in shareable.items()}
        if cache is not None:
            cache.devices = (worth, shareable, capacities)
    cached_jobs: dict[str, _JobRead] = {}
    same_nodes = cache is not None and cache.served == known_nodes  # frozenset == set compares the members
    reach_by_selectors: dict[tuple[str, ...], frozenset[str]] = {}  # channel selectors -> nodes they accept
    counted: set[str] = set()  # claims already counted: a claim shared by several pods counts once
    seated: dict[tuple[str, int], int] = {}  # (node, GPU index) -> milli-GPUs of the shares seated there
    # A pod holds whole milli-GPUs; each queue's fractions are rounded as a running sum, so nine 8Gi shares of a
    # 79.6 GiB H100 hold 904 milli in their queue (100 or 101 a pod), not nine times 100.
    exact: dict[str, float] = {}
    first_seen: dict[str, float] = {}  # waiting job -> when first seen waiting (World.weighed)
    room: dict[str, tuple[tuple[float, int], tuple[float, int]]] = {}  # node -> devices free now, and when empty

    def rooms(nodes: frozenset[str] | None) -> tuple[Room, Room]:
        """What the nodes (None: every managed one) have for a firstAvailable claim (choose), now and empty."""
        if not room:
            room.update(_device_room(slices, objects.claims.values(), driver, known_nodes))
        picked = [room[n] for n in (known_nodes if nodes is None else nodes & known_nodes)]
        return [now for now, _ in picked], [ever for _, ever in picked]

    for job, gang in sorted(found.gangs.items()):
        if job in found.left_out:
            continue
        inputs: tuple[Any, ...] = ()
        context: tuple[Any, ...] = ()
        if cache is not None:
            before = exact.get(gang.queue, 0.0)
            context = _job_context(gang, found, whole_before=before.is_integer(), weighed=weighed)
            hit = cache.jobs.get(job)
            if hit is not None and hit.context != context:
                hit = None
            if hit is not None and hit.gang is gang and same_nodes:
                inputs = hit.inputs  # kept by the grouping: walking its members would find them unchanged
            else:
                inputs = _job_inputs(gang, found, groups, known_nodes)
            if (
                hit is not None
                and hit.inputs == inputs
                and counted.isdisjoint(hit.claims)
                and (not hit.fractional or hit.exact_before == before)
            ):
                jobs.append(hit.job)
                exact[gang.queue] = hit.exact_after if hit.fractional else before + (hit.exact_after - hit.exact_before)
                counted.update(hit.claims)
                if hit.first_seen is not None:
                    first_seen[job] = hit.first_seen
                hit.gang = gang  # the same inputs: the grouping's gang now, so that the next look is short
                cached_jobs[job] = hit
                continue
            cache.jobs_weighed += 1
        volatile = False  # weighed from more than `inputs`: not remembered
        exact_before = exact.get(gang.queue, 0.0)
        fractional = not exact_before.is_integer()  # (half a milli rounds to even: after a fraction, all depend)
        one_clique = False  # its pods share a ComputeDomain (a channel claim): one NVLink clique for all
        channels_asked: dict[str, int] = {}  # pod key -> its channel claims not allocated yet
        channels_reach: dict[str, frozenset[str]] = {}  # pod key -> nodes its channel claims' selectors accept
        claims_counted: list[str] = []
        pods_out = []
        group = groups.get(f"{gang.namespace}/{gang.pod_group}") if gang.pod_group else None
        priority = 0
        created: float | None = parse_rfc3339(meta(group).get("creationTimestamp")) if group else None
        unsupported = ""
        started: float | None = None  # when the gang last started: min-runtime protection counts from it
        for key, member in sorted(gang.members.items()):
            status = statuses[key]
            if status != "Pending" and member.node not in known_nodes:
                continue  # on a node the arbiter does not manage: its devices are not ours to count
            try:
                gpus = 0.0
                for c in member.claims:
                    if domains.is_channel_claim(c):  # not a GPU: kube-scheduler allocates it where the pod goes
                        one_clique = True
                        channels_asked[key] = channels_asked.get(key, 0) + (not is_allocated(c))
                        pinned = domains.channel_selectors(c) if not is_allocated(c) else ()
                        if pinned:
                            volatile = True  # read from the slices, which the job's inputs do not cover
                            if pinned not in reach_by_selectors:
                                reach_by_selectors[pinned] = domains.channel_nodes(pinned, slices)
                            reach = reach_by_selectors[pinned]
                            channels_reach[key] = channels_reach[key] & reach if key in channels_reach else reach
                        continue
                    ref = f"{meta(c).get('namespace')}/{meta(c).get('name')}"
                    if ref in counted:
                        volatile = volatile or ref not in claims_counted  # counted by another gang
                    else:
                        counted.add(ref)
                        claims_counted.append(ref)
                        choice = None
                        # the nodes' room is read only for a claim with choices (most have none)
                        if status == "Pending" and not is_allocated(c) and first_available(c):
                            volatile = True
                            nodes_now, nodes_ever = rooms(allowed.get(key))
                            choice = choose(c, nodes_now, nodes_ever)
                            # a member is kept between snapshots while its pod and claims are: chosen anew
                            if choice is not None:
                                member.choices[str(meta(c).get("name"))] = choice
                            else:
                                member.choices.pop(str(meta(c).get("name")), None)
                        gpus += claim_gpus(c, driver, worth, capacities, shareable, choice=choice)
            except Unsupported as e:
                unsupported = f"{key}: {e}"
                gpus = 0
            except (AttributeError, KeyError, TypeError, ValueError) as e:  # a malformed claim: reported, not fatal
                malformed = c or {}
                bad = Invalid("ResourceClaim", malformed, f"the arbiter cannot read this claim: {e!r}")
                invalid[bad.key] = bad
                unsupported = f"{key}: ResourceClaim {meta(malformed).get('name')} is malformed"
                gpus = 0
            facts = _facts(member.pod)
            cpu, mem = facts.cpu, facts.mem
            pod_priority = (member.pod.get("spec") or {}).get("priority")
            priority = max(priority, int(pod_priority or 0))
            born = facts.born
            if born is not None and (created is None or born < created) and group is None:
                created = born
            before = exact.get(gang.queue, 0.0)
            fractional = fractional or not float(gpus * MILLI).is_integer()  # gpus may be an int 0
            exact[gang.queue] = before + gpus * MILLI
            milli = round(exact[gang.queue]) - round(before)
            index = None
            if status != "Pending" and 0 < milli < MILLI and member.node is not None:
                volatile = True  # seated beside other gangs' shares
                index = _share_index(member.claims, driver, member.node, gpu_index)
                if index is not None:  # never more than a GPU, whatever the rounding: the cycle must go on
                    milli = min(milli, MILLI - seated.get((member.node, index), 0))
                    seated[(member.node, index)] = seated.get((member.node, index), 0) + milli
            pods_out.append(
                PodSpec(
                    name=key,
                    gpu_milli=milli,
                    cpu_milli=cpu,
                    gpu_index=index if milli else None,
                    mem_bytes=mem,
                    status=status,
                    node=member.node if status != "Pending" else None,
                    allowed_nodes=_narrowed(allowed.get(key), channels_reach.get(key)),
                    other={**facts.other, domains.CHANNEL_RESOURCE: channels_asked[key]}
                    if channels_asked.get(key)
                    else facts.other,
                )
            )
            admitted = parse_rfc3339((meta(member.pod).get("annotations") or {}).get(ADMITTED_ANNOTATION))
            if status == "Running" and admitted is not None:
                started = admitted if started is None else max(started, admitted)
        if unsupported and any(p.status == "Pending" for p in pods_out):
            waiting[job] = f"unsupported claim: {unsupported}"
            continue
        if not pods_out:
            continue
        pending = any(p.status == "Pending" for p in pods_out)
        # `now` stands in for a missing creation time, and for the first sight of a waiting gang
        volatile = volatile or bool(unsupported) or created is None or (pending and not (weighed and job in weighed))
        if group is not None:
            group_priority = (group.get("spec") or {}).get("priority")
            if group_priority is not None:
                priority = int(group_priority)
        since = None
        if any(p.status == "Pending" for p in pods_out):
            # A reclaimer spares jobs admitted while it waited (evict.same_burst). Both times must tell apart
            # moments within one second: the admissions are this arbiter's own sub-second decision times, and
            # the gang began waiting when this arbiter first saw it, or at the latest within its creation second
            # (creationTimestamp is truncated to whole seconds), whichever came first: after a restart its
            # predecessor may have weighed it since its creation.
            first_seen[job] = (weighed or {}).get(job, now)
            since = min(first_seen[job], (created or now) + 1.0)
        # minCount may exceed the pods created so far: the gang then waits for the rest
        spec = JobSpec(
            name=job,
            queue=gang.queue,
            priority=priority,
            preemptible=priority < NON_PREEMPTIBLE_PRIORITY and job not in found.flying,
            min_member=gang.min_member,
            created_at=created or now,
            pods=tuple(pods_out),
            started_at=started,
            weighed_since=since,
            one_clique=one_clique,
        )
        jobs.append(spec)
        if cache is not None and not volatile:
            cached_jobs[job] = _JobRead(
                inputs,
                _job_objects(gang, groups),
                gang,
                context,
                spec,
                exact_before,
                exact.get(gang.queue, 0.0),
                fractional,
                tuple(claims_counted),
                first_seen.get(job),
            )
    if cache is not None:
        cache.jobs = cached_jobs  # gangs gone, or weighed from more than their inputs, are forgotten
        cache.served = frozenset(known_nodes)
    return _Jobs(jobs, shareable, first_seen, waiting, invalid)


def _job_context(
    gang: Gang, found: _Gangs, *, whole_before: bool, weighed: Mapping[str, float] | None
) -> tuple[Any, ...]:
    """What a gang is weighed from (WorldCache) besides its own objects (_job_inputs)."""
    return (whole_before, (weighed or {}).get(gang.name), gang.name in found.flying)


def _job_inputs(gang: Gang, found: _Gangs, groups: Mapping[str, Json], known_nodes: set[str]) -> tuple[Any, ...]:
    """What a gang is weighed from (WorldCache) of its own: objects by identity (_job_objects keeps them alive),
    the rest by value."""
    group = groups.get(f"{gang.namespace}/{gang.pod_group}") if gang.pod_group else None
    members = tuple(
        (
            key,
            id(m.pod),
            found.statuses[key],
            m.node,
            m.node in known_nodes,
            tuple(id(c) for c in m.claims),
            found.allowed.get(key),
        )
        for key, m in sorted(gang.members.items())
    )
    return (gang.queue, gang.min_member, gang.pod_group, id(group), members)


def _job_objects(gang: Gang, groups: Mapping[str, Json]) -> tuple[Any, ...]:
    group = groups.get(f"{gang.namespace}/{gang.pod_group}") if gang.pod_group else None
    return (group, *(m.pod for m in gang.members.values()), *(c for m in gang.members.values() for c in m.claims))


def build_world(
    *,
    pods: Iterable[Json],
    claims: Iterable[Json],
    pod_groups: Iterable[Json],
    queues: Iterable[Json],
    nodes: Iterable[Json],
    slices: Iterable[Json],
    driver: str,
    now: float,
    default_queue: str | None = DEFAULT_QUEUE,
    in_flight: Mapping[str, str] | None = None,
    weighed: Mapping[str, float] | None = None,
    refused_claims: Mapping[str, str] | None = None,
    cache: WorldCache | None = None,
) -> World:
    """`in_flight`: pod key -> node, the members of gangs whose commit is still under way. They count as
    running there whatever part of the commit the informers show yet, so the cycle neither decides them again
    nor places anything on what they take; and they are no one's victims until the commit has landed.
    `weighed`: job -> when the caller's earlier snapshots first had it waiting (World.weighed of the last one);
    a waiting job not in it is first seen `now`.
    `cache`: the WorldCache of the caller's earlier snapshots; the snapshot is the same with it, built faster.
    `refused_claims`: claim key -> why a node refused it as written; a pending pod with one waits, saying so."""
    objects = _read_objects(claims, pod_groups, queues, slices)
    if cache is not None:
        cache.read_slices(objects.slices)
        cache.pods_read = cache.jobs_weighed = 0
    served = _serve_nodes(nodes, objects.slices, driver, cache)
    found = _group_gangs(
        pods,
        objects,
        served.managed,
        default_queue=default_queue,
        in_flight=in_flight,
        refused_claims=refused_claims,
        cache=cache,
    )
    weighed_nodes = _weigh_nodes(objects, served, found, driver)
    weighed_gangs = _weigh_gangs(objects, found, weighed_nodes, driver, now=now, weighed=weighed, cache=cache)
    waiting = {**found.waiting}
    waiting.update(weighed_gangs.waiting)
    invalid = {**objects.invalid, **found.invalid, **weighed_gangs.invalid}
    leaf_jobs = [j for j in weighed_gangs.jobs if j.queue in objects.by_queue and j.queue not in objects.children]
    snapshot = Snapshot(nodes=tuple(weighed_nodes.specs), queues=tuple(objects.queues), jobs=tuple(leaf_jobs), now=now)
    return World(
        snapshot,
        found.gangs,
        found.members,
        waiting,
        weighed_nodes.addresses,
        [q.name for q in objects.queues],
        invalid,
        found.release,
        weighed_nodes.doubles,
        shareable=weighed_gangs.shareable,
        unbindable=found.refused,
        unserved=served.unserved,
        weighed=weighed_gangs.first_seen,
        stranded=found.stranded,
    )


def _narrowed(allowed: frozenset[str] | None, reach: frozenset[str] | None) -> frozenset[str] | None:
    """A pod's nodes: those its rules allow (None: all) and its channel claims' selectors accept (None: any)."""
    if reach is None:
        return allowed
    return reach if allowed is None else allowed & reach
