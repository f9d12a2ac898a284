"""Parse and validate a snapshot document (already decoded from JSON) into the model.

Every rejection is a `SnapshotError` whose message is one sentence naming the offending object, so the
`simulate` command can print it as is.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, cast

from agent.arbiter.core.model import (
    CPU_POLICIES,
    GPU_POLICIES,
    MILLI,
    NON_PREEMPTIBLE_PRIORITY,
    RESOURCES,
    UNLIMITED,
    Fairness,
    GpuPolicy,
    JobSpec,
    NodeSpec,
    Placement,
    PodSpec,
    PodStatus,
    Policy,
    QueueSpec,
    ResourceTerms,
    Snapshot,
)
from agent.arbiter.core.usage import UsageSample, queue_usage
from agent.times import parse_rfc3339

_STATUSES = ("Running", "Pending", "Releasing")
# Caps that keep a typo from costing minutes and gigabytes: a node's GPUs are modelled one by one.
MAX_NODE_GPUS = 1024
MAX_NUMBER = 1e18  # any quantity; far above a real one, far below where float sums lose integers or overflow

# The fields of each object; anything else is refused (a misspelt "gpu" for "gpus" would silently count 0).
_FIELDS = {
    "the snapshot": ("config", "nodes", "queues", "jobs", "now", "fairness"),
    "config": ("placement",),
    "config.placement": ("gpu", "cpu"),
    "node": ("name", "gpus", "cpuMilli", "memBytes", "gpuModel", "labels", "nvlinkDomains", "gpuMemory"),
    "queue": ("name", "parent", "priority", *RESOURCES, "preemptMinRuntime", "reclaimMinRuntime"),
    "queue resource": ("quota", "limit", "overQuotaWeight"),
    "job": (
        "name",
        "queue",
        "priority",
        "preemptible",
        "minMember",
        "createdAt",
        "pods",
        "startedAt",
        "preemptionDelay",
        "pendingSince",
    ),
    "pod": (
        "name",
        "gpus",
        "gpuMemory",
        "status",
        "node",
        "gpuIndex",
        "cpuMilli",
        "memBytes",
        "taskPriority",
        "nodeSelector",
    ),
    "fairness": ("kValue", "usage", "history", "windowSize", "halfLife"),
    "fairness usage": RESOURCES,
    "fairness history": ("queue", "start", "end", "gpus", "cpuMilli", "memBytes"),
}
_POLICIES = {"gpu": GPU_POLICIES, "cpu": CPU_POLICIES}


class SnapshotError(ValueError):
    """The snapshot is malformed or inconsistent; the message says where."""


def parse_snapshot(doc: object) -> Snapshot:
    top = _obj(doc, "the snapshot", "the snapshot")
    placement = _placement(top.get("config"))
    raw_nodes = _list(top, "nodes", "the snapshot")
    nodes = tuple(_node(n, i) for i, n in enumerate(raw_nodes))
    gpu_memory = _gpu_memory(raw_nodes, nodes)
    queues = tuple(_queue(q, i) for i, q in enumerate(_list(top, "queues", "the snapshot")))
    selected = _Selected(nodes)
    jobs = tuple(_job(j, i, gpu_memory, selected) for i, j in enumerate(_list(top, "jobs", "the snapshot")))
    now = _timestamp(top["now"], "the snapshot", "now") if top.get("now") is not None else None
    fairness = _fairness(top.get("fairness"), queues, nodes, now)
    snapshot = Snapshot(nodes=nodes, queues=queues, jobs=jobs, placement=placement, fairness=fairness, now=now)
    _check_references(snapshot)
    return snapshot


# -- objects ---------------------------------------------------------------------------------------------


def _placement(raw: object) -> Placement:
    if raw is None:
        return Placement()
    config = _obj(raw, "config", "config")
    placement = _obj(config.get("placement", {}), "config.placement", "config.placement")
    default = Placement()
    gpu = placement.get("gpu", default.gpu)
    cpu = placement.get("cpu", default.cpu)
    for resource, value in (("gpu", gpu), ("cpu", cpu)):
        if value not in _POLICIES[resource]:
            raise SnapshotError(
                f"config.placement.{resource} must be {' or '.join(_POLICIES[resource])}, not {value!r}."
            )
    return Placement(gpu=cast(GpuPolicy, gpu), cpu=cast(Policy, cpu))


def _node(raw: object, index: int) -> NodeSpec:
    node = _obj(raw, f"nodes[{index}]")
    name = _name(node, f"nodes[{index}]")
    where = f"node {name!r}"
    _known_fields(node, "node", where)
    gpus = _quantity(node, "gpus", where)
    if gpus != int(gpus):
        raise SnapshotError(f"{where} has a fractional GPU count {gpus}.")
    if gpus > MAX_NODE_GPUS:
        raise SnapshotError(f"{where} has {gpus:g} GPUs, more than the {MAX_NODE_GPUS} a node may have here.")
    domains = []
    seen: set[int] = set()
    for domain in _opt_list(node, "nvlinkDomains", where):
        if not isinstance(domain, list) or not all(type(i) is int for i in domain):
            raise SnapshotError(f"{where} has an nvlinkDomains entry that is not a list of GPU indices.")
        for i in domain:
            if not 0 <= i < gpus or i in seen:
                raise SnapshotError(f"{where} names GPU index {i} in nvlinkDomains twice or out of range.")
            seen.add(i)
        domains.append(tuple(sorted(domain)))
    model = node.get("gpuModel")
    if model is not None and not isinstance(model, str):
        raise SnapshotError(f"{where} has a gpuModel that is not a string.")
    return NodeSpec(
        name=name,
        gpus=int(gpus),
        cpu_milli=_quantity(node, "cpuMilli", where),
        mem_bytes=_quantity(node, "memBytes", where),
        gpu_model=model,
        labels=_labels(node, "labels", where),
        nvlink_domains=tuple(domains),
    )


def _queue(raw: object, index: int) -> QueueSpec:
    queue = _obj(raw, f"queues[{index}]")
    name = _name(queue, f"queues[{index}]")
    where = f"queue {name!r}"
    _known_fields(queue, "queue", where)
    if "parent" not in queue:
        raise SnapshotError(f"{where} has no parent field (use null for a top-level queue).")
    parent = queue["parent"]
    if parent is not None and not isinstance(parent, str):
        raise SnapshotError(f"{where} has a parent that is not a queue name.")
    terms = []
    for resource in RESOURCES:
        if resource not in queue and resource != "gpu":
            terms.append(ResourceTerms())
            continue
        block = _obj(queue.get(resource), f"{where} {resource}", "queue resource")
        scale = MILLI if resource == "gpu" else 1
        quota, limit, weight = (_term(block, key, f"{where} {resource}") for key in _TERM_KEYS)
        terms.append(
            ResourceTerms(
                quota=quota * scale if quota != UNLIMITED else UNLIMITED,
                limit=limit * scale if limit != UNLIMITED else UNLIMITED,
                over_quota_weight=weight,
            )
        )
    return QueueSpec(
        name=name,
        parent=parent,
        priority=_int(queue, "priority", where, default=100),
        terms=(terms[0], terms[1], terms[2]),
        preempt_min_runtime=_opt_duration(queue, "preemptMinRuntime", where),
        reclaim_min_runtime=_opt_duration(queue, "reclaimMinRuntime", where),
    )


_TERM_KEYS = ("quota", "limit", "overQuotaWeight")


def _gpu_memory(raw_nodes: list[Any], nodes: tuple[NodeSpec, ...]) -> dict[str, float]:
    """Each node's per-GPU memory in bytes, where it says (`gpuMemory`): what a pod's `gpuMemory` share is of."""
    out = {}
    for raw, node in zip(raw_nodes, nodes, strict=True):
        if "gpuMemory" in raw:
            out[node.name] = _quantity(raw, "gpuMemory", f"node {node.name!r}")
            if out[node.name] <= 0:
                raise SnapshotError(f"node {node.name!r} has a gpuMemory of {out[node.name]:g}; it must be positive.")
    return out


class _Selected:
    """The nodes a pod's `nodeSelector` allows, as the model's `allowed_nodes` (None: every node), worked out
    once per distinct selector."""

    def __init__(self, nodes: tuple[NodeSpec, ...]) -> None:
        self._nodes = nodes
        self._seen: dict[tuple[tuple[str, str], ...], frozenset[str] | None] = {}

    def allowed(self, selector: Mapping[str, str]) -> frozenset[str] | None:
        if not selector:
            return None
        key = tuple(sorted(selector.items()))
        if key not in self._seen:
            names = frozenset(n.name for n in self._nodes if all(n.labels.get(k) == v for k, v in key))
            self._seen[key] = None if len(names) == len(self._nodes) else names
        return self._seen[key]


def _job(raw: object, index: int, gpu_memory: Mapping[str, float], selected: _Selected) -> JobSpec:
    job = _obj(raw, f"jobs[{index}]")
    name = _name(job, f"jobs[{index}]")
    where = f"job {name!r}"
    _known_fields(job, "job", where)
    queue = job.get("queue")
    if not isinstance(queue, str):
        raise SnapshotError(f"{where} has no queue name.")
    priority = _int(job, "priority", where, default=0)
    preemptible = job.get("preemptible", priority < NON_PREEMPTIBLE_PRIORITY)
    if not isinstance(preemptible, bool):
        raise SnapshotError(f"{where} has a preemptible field that is not true or false.")
    pods = tuple(_pod(p, where, i, gpu_memory, selected) for i, p in enumerate(_list(job, "pods", where)))
    min_member = _int(job, "minMember", where, default=len(pods))
    if min_member < 0:
        raise SnapshotError(f"{where} has a negative minMember {min_member}.")
    return JobSpec(
        name=name,
        queue=queue,
        priority=priority,
        preemptible=preemptible,
        min_member=min_member,
        created_at=_timestamp(job.get("createdAt"), where),
        pods=pods,
        started_at=_timestamp(job["startedAt"], where, "startedAt") if job.get("startedAt") is not None else None,
        preemption_delay=_opt_duration(job, "preemptionDelay", where) or 0.0,
        pending_since=(
            _timestamp(job["pendingSince"], where, "pendingSince") if job.get("pendingSince") is not None else None
        ),
    )


def _share(pod: Mapping[str, Any], where: str, gpu_memory: Mapping[str, float]) -> float:
    """A consumable-capacity share (`gpuMemory` bytes of one GPU) as a GPU fraction: of its node's GPU, or of
    the largest GPU for a pending pod, rounded up to the next milli-GPU so shares never overfill a GPU (nine
    8Gi shares of a 79.6 GiB H100 are 0.101 each: nine fit, a tenth does not)."""
    if "gpus" in pod:
        raise SnapshotError(f"{where} has both gpus and gpuMemory; a share names only its gpuMemory.")
    memory = _quantity(pod, "gpuMemory", where)
    node = pod.get("node")
    whole = gpu_memory.get(node) if isinstance(node, str) else max(gpu_memory.values(), default=None)
    if whole is None:
        raise SnapshotError(
            f"{where} asks for gpuMemory, but {'its node' if node else 'no node'} says its GPUs' gpuMemory."
        )
    if memory <= 0 or memory > whole:
        raise SnapshotError(
            f"{where} asks for {memory:g} bytes of GPU memory; a share is more than 0 and at most a GPU's {whole:g}."
        )
    return math.ceil(round(memory / whole * MILLI, 9)) / MILLI


def _pod(raw: object, job: str, index: int, gpu_memory: Mapping[str, float], selected: _Selected) -> PodSpec:
    pod = _obj(raw, f"{job} pods[{index}]")
    name = _name(pod, f"{job} pods[{index}]")
    where = f"pod {name!r}"
    _known_fields(pod, "pod", where)
    gpus = _share(pod, where, gpu_memory) if "gpuMemory" in pod else _quantity(pod, "gpus", where, default=0.0)
    if gpus > MAX_NODE_GPUS:
        raise SnapshotError(f"{where} asks for {gpus:g} GPUs, more than any node may have ({MAX_NODE_GPUS}).")
    if gpus > 1 and gpus != int(gpus):
        raise SnapshotError(f"{where} asks for {gpus} GPUs: use a whole number or a fraction of one GPU.")
    gpu_milli = round(gpus * MILLI)
    if gpus > 0 and gpu_milli == 0:
        raise SnapshotError(f"{where} asks for {gpus} GPUs, less than a thousandth of one.")
    status = pod.get("status", "Pending")
    if status not in _STATUSES:
        raise SnapshotError(f"{where} has status {status!r}; expected Running, Pending or Releasing.")
    node = pod.get("node")
    if node is not None and not isinstance(node, str):
        raise SnapshotError(f"{where} has a node that is not a node name.")
    if (node is None) != (status == "Pending"):
        raise SnapshotError(f"{where} is {status} but its node is {node!r}; only pending pods have no node.")
    gpu_index = pod.get("gpuIndex")
    if gpu_index is not None and type(gpu_index) is not int:
        raise SnapshotError(f"{where} has a gpuIndex that is not a GPU index: {gpu_index!r}.")
    if gpu_index is not None and (not 0 < gpu_milli < MILLI or node is None):
        raise SnapshotError(f"{where} has a gpuIndex but is not a placed fractional-GPU pod.")
    return PodSpec(
        name=name,
        gpu_milli=gpu_milli,
        cpu_milli=_quantity(pod, "cpuMilli", where, default=0.0),
        mem_bytes=_quantity(pod, "memBytes", where, default=0.0),
        status=cast(PodStatus, status),
        node=node,
        gpu_index=gpu_index,
        task_priority=_int(pod, "taskPriority", where, default=0),
        allowed_nodes=selected.allowed(_labels(pod, "nodeSelector", where)),
    )


# -- cross references ------------------------------------------------------------------------------------


def _check_references(snapshot: Snapshot) -> None:
    _unique("node", [n.name for n in snapshot.nodes])
    _unique("queue", [q.name for q in snapshot.queues])
    _unique("job", [j.name for j in snapshot.jobs])
    _unique("pod", [p.name for j in snapshot.jobs for p in j.pods])
    queues = {q.name: q for q in snapshot.queues}
    for q in snapshot.queues:
        if q.parent is not None and q.parent not in queues:
            raise SnapshotError(f"queue {q.name!r} names an unknown parent queue {q.parent!r}.")
    for q in snapshot.queues:
        seen = {q.name}
        parent = q.parent
        while parent is not None:
            if parent in seen:
                raise SnapshotError(f"queue {q.name!r} is part of a cycle in the queue tree.")
            seen.add(parent)
            parent = queues[parent].parent
    parents = {q.parent for q in snapshot.queues}
    nodes = {n.name: n for n in snapshot.nodes}
    for job in snapshot.jobs:
        if job.queue not in queues:
            raise SnapshotError(f"job {job.name!r} names an unknown queue {job.queue!r}.")
        if job.queue in parents:
            raise SnapshotError(f"job {job.name!r} is in {job.queue!r}, a parent queue; only leaf queues hold jobs.")
        for pod in job.pods:
            if pod.node is None:
                continue
            node = nodes.get(pod.node)
            if node is None:
                raise SnapshotError(f"pod {pod.name!r} runs on an unknown node {pod.node!r}.")
            if pod.gpu_index is not None and not 0 <= pod.gpu_index < node.gpus:
                raise SnapshotError(f"pod {pod.name!r} shares GPU {pod.gpu_index}, which node {node.name!r} lacks.")


def _unique(kind: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise SnapshotError(f"{kind} name {name!r} appears more than once.")
        seen.add(name)


# -- fields ----------------------------------------------------------------------------------------------


def _obj(raw: object, where: str, kind: str | None = None) -> Mapping[str, Any]:
    """A JSON object; with `kind`, one holding only that kind's fields."""
    if not isinstance(raw, dict):
        raise SnapshotError(f"{where} must be a JSON object.")
    if kind is not None:
        _known_fields(raw, kind, where)
    return cast(Mapping[str, Any], raw)


def _known_fields(obj: Mapping[str, Any], kind: str, where: str) -> None:
    allowed = _FIELDS[kind]
    unknown = sorted(str(k) for k in obj if k not in allowed)
    if unknown:
        raise SnapshotError(f"{where} has an unknown field {unknown[0]!r}; known fields: {', '.join(allowed)}.")


def _list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list):
        raise SnapshotError(f"{where} needs a list {key!r}.")
    return value


def _opt_list(obj: Mapping[str, Any], key: str, where: str) -> list[Any]:
    return _list(obj, key, where) if obj.get(key) is not None else []


def _name(obj: Mapping[str, Any], where: str) -> str:
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"{where} has no name.")
    return name


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SnapshotError(f"{what} must be a number, not {_short(value)}.")
    try:
        number = float(value)
    except OverflowError:  # an integer with hundreds of digits
        number = math.inf
    if not math.isfinite(number) or abs(number) > MAX_NUMBER:
        raise SnapshotError(f"{what} must be a number of at most {MAX_NUMBER:g}, not {_short(value)}.")
    return number


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _quantity(obj: Mapping[str, Any], key: str, where: str, default: float | None = None) -> float:
    if key not in obj and default is not None:
        return default
    value = _number(obj.get(key), f"{where} {key}")
    if value < 0:
        raise SnapshotError(f"{where} has a negative {key} {value:g}.")
    return value


def _term(block: Mapping[str, Any], key: str, where: str) -> float:
    default = 1.0 if key == "overQuotaWeight" else UNLIMITED
    value = _number(block.get(key, default), f"{where} {key}")
    if value < 0 and value != UNLIMITED:
        raise SnapshotError(f"{where} has a negative {key} {value:g} (only -1, unlimited, is allowed).")
    return value


def _int(obj: Mapping[str, Any], key: str, where: str, default: int) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SnapshotError(f"{where} has a {key} that is not an integer: {value!r}.")
    return value


def _labels(obj: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = obj.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise SnapshotError(f"{where} has {key} that is not a map of strings.")
    return dict(value)


def _timestamp(value: object, where: str, key: str = "createdAt") -> float:
    if not isinstance(value, str):
        raise SnapshotError(f"{where} needs {key} as an RFC 3339 timestamp.")
    parsed = parse_rfc3339(value)
    if parsed is None:
        raise SnapshotError(f"{where} has a malformed {key} {value!r} (want RFC 3339 with a time zone).")
    return parsed


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def go_duration(text: object) -> float | None:
    """A Go duration ("90s", "1h30m", "250ms", as metav1.Duration writes them) in seconds; None when absent
    or malformed. One parser for snapshots and for the Queue objects the arbiter reads."""
    if not isinstance(text, str) or not text:
        return None
    if text == "0":
        return 0.0
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(n) * _UNIT[u] for n, u in parts)


def duration(value: object, what: str) -> float:
    seconds = go_duration(value)
    if seconds is None:
        raise SnapshotError(f'{what} must be a duration such as "5m" or "1h30m", not {value!r}.')
    return seconds


def _opt_duration(obj: Mapping[str, Any], key: str, where: str) -> float | None:
    value = obj.get(key)
    return None if value is None else duration(value, f"{where} {key}")


def _fairness(raw: object, queues: tuple[QueueSpec, ...], nodes: tuple[NodeSpec, ...], now: float | None) -> Fairness:
    """Time-aware fair share: `usage` per queue (normalised, 0..1), or a `history` of what queues held, with
    `windowSize` and an optional `halfLife`, folded into usage as of `now`; `kValue` (default 1)."""
    if raw is None:
        return Fairness()
    block = _obj(raw, "fairness", "fairness")
    k_value = _number(block.get("kValue", 1.0), "fairness kValue")
    if k_value < 0:
        raise SnapshotError(f"fairness kValue must not be negative, not {k_value:g}.")
    usage: dict[str, tuple[float, float, float]] = {}
    for name, value in _obj(block.get("usage", {}), "fairness usage").items():
        entry = _obj(value, f"fairness usage of {name!r}", "fairness usage")
        usage[name] = (_fraction(entry, "gpu", name), _fraction(entry, "cpu", name), _fraction(entry, "memory", name))
    history = block.get("history")
    if history is not None:
        if now is None:
            raise SnapshotError("fairness history needs the snapshot's now.")
        window = duration(block.get("windowSize"), "fairness windowSize")
        half_life = _opt_duration(block, "halfLife", "fairness")
        samples = [_sample(s, i) for i, s in enumerate(_list(block, "history", "fairness"))]
        capacity = (
            float(sum(n.gpus for n in nodes) * MILLI),
            sum(n.cpu_milli for n in nodes),
            sum(n.mem_bytes for n in nodes),
        )
        usage.update(queue_usage(samples, queues, capacity, now=now, window=window, half_life=half_life))
    return Fairness(usage=usage, k_value=k_value)


def _fraction(entry: Mapping[str, Any], key: str, queue: str) -> float:
    value = _number(entry.get(key, 0.0), f"fairness usage of {queue!r} {key}")
    if not 0 <= value <= 1:
        raise SnapshotError(f"fairness usage of {queue!r} {key} must be between 0 and 1, not {value:g}.")
    return value


def _sample(raw: object, index: int) -> UsageSample:
    where = f"fairness history[{index}]"
    sample = _obj(raw, where, "fairness history")
    queue = sample.get("queue")
    if not isinstance(queue, str):
        raise SnapshotError(f"{where} has no queue name.")
    start = _timestamp(sample.get("start"), where, "start")
    end = _timestamp(sample.get("end"), where, "end")
    if end < start:
        raise SnapshotError(f"{where} ends before it starts.")
    return UsageSample(
        queue,
        start,
        end,
        (
            _quantity(sample, "gpus", where, 0.0) * MILLI,
            _quantity(sample, "cpuMilli", where, 0.0),
            _quantity(sample, "memBytes", where, 0.0),
        ),
    )
