"""Parse and validate a snapshot document (already decoded from JSON) into the model.

Every rejection is a `SnapshotError` whose message is one sentence naming the offending object, so the
`simulate` command can print it as is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import datetime
from typing import Any, cast

from agent.arbiter.core.model import (
    MILLI,
    NON_PREEMPTIBLE_PRIORITY,
    RESOURCES,
    UNLIMITED,
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

_STATUSES = ("Running", "Pending", "Releasing")
_POLICIES = ("binpack", "spread")


class SnapshotError(ValueError):
    """The snapshot is malformed or inconsistent; the message says where."""


def parse_snapshot(doc: object) -> Snapshot:
    top = _obj(doc, "the snapshot")
    placement = _placement(top.get("config"))
    nodes = tuple(_node(n, i) for i, n in enumerate(_list(top, "nodes", "the snapshot")))
    queues = tuple(_queue(q, i) for i, q in enumerate(_list(top, "queues", "the snapshot")))
    jobs = tuple(_job(j, i) for i, j in enumerate(_list(top, "jobs", "the snapshot")))
    snapshot = Snapshot(nodes=nodes, queues=queues, jobs=jobs, placement=placement)
    _check_references(snapshot)
    return snapshot


# -- objects ---------------------------------------------------------------------------------------------


def _placement(raw: object) -> Placement:
    if raw is None:
        return Placement()
    config = _obj(raw, "config")
    placement = _obj(config.get("placement", {}), "config.placement")
    policies: dict[str, Policy] = {}
    for resource in ("gpu", "cpu"):
        value = placement.get(resource, "binpack")
        if value not in _POLICIES:
            raise SnapshotError(f"config.placement.{resource} must be binpack or spread, not {value!r}.")
        policies[resource] = cast(Policy, value)
    return Placement(gpu=policies["gpu"], cpu=policies["cpu"])


def _node(raw: object, index: int) -> NodeSpec:
    node = _obj(raw, f"nodes[{index}]")
    name = _name(node, f"nodes[{index}]")
    where = f"node {name!r}"
    gpus = _quantity(node, "gpus", where)
    if gpus != int(gpus):
        raise SnapshotError(f"{where} has a fractional GPU count {gpus}.")
    domains = []
    seen: set[int] = set()
    for domain in _opt_list(node, "nvlinkDomains", where):
        if not isinstance(domain, list) or not all(isinstance(i, int) for i in domain):
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
        block = _obj(queue.get(resource), f"{where} {resource}")
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
    )


_TERM_KEYS = ("quota", "limit", "overQuotaWeight")


def _job(raw: object, index: int) -> JobSpec:
    job = _obj(raw, f"jobs[{index}]")
    name = _name(job, f"jobs[{index}]")
    where = f"job {name!r}"
    queue = job.get("queue")
    if not isinstance(queue, str):
        raise SnapshotError(f"{where} has no queue name.")
    priority = _int(job, "priority", where, default=0)
    preemptible = job.get("preemptible", priority < NON_PREEMPTIBLE_PRIORITY)
    if not isinstance(preemptible, bool):
        raise SnapshotError(f"{where} has a preemptible field that is not true or false.")
    pods = tuple(_pod(p, where, i) for i, p in enumerate(_list(job, "pods", where)))
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
    )


def _pod(raw: object, job: str, index: int) -> PodSpec:
    pod = _obj(raw, f"{job} pods[{index}]")
    name = _name(pod, f"{job} pods[{index}]")
    where = f"pod {name!r}"
    gpus = _quantity(pod, "gpus", where, default=0.0)
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
    if gpu_index is not None and (not isinstance(gpu_index, int) or not 0 < gpu_milli < MILLI or node is None):
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
        node_selector=_labels(pod, "nodeSelector", where),
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


def _obj(raw: object, where: str) -> Mapping[str, Any]:
    if not isinstance(raw, dict):
        raise SnapshotError(f"{where} must be a JSON object.")
    return cast(Mapping[str, Any], raw)


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
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SnapshotError(f"{what} must be a number, not {value!r}.")
    return float(value)


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


def _timestamp(value: object, where: str) -> float:
    if not isinstance(value, str):
        raise SnapshotError(f"{where} needs createdAt as an RFC 3339 timestamp.")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise SnapshotError(f"{where} has a malformed createdAt {value!r} (want RFC 3339).") from None
    if parsed.tzinfo is None or "T" not in value.upper():
        raise SnapshotError(f"{where} has a malformed createdAt {value!r} (want RFC 3339 with a time zone).")
    return parsed.timestamp()
