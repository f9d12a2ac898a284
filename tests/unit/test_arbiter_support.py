"""Builders for arbiter snapshot documents (the `simulate` input format), shared by the arbiter tests."""

from __future__ import annotations

from typing import Any

from agent.arbiter.core.cycle import CycleResult, run_cycle
from agent.arbiter.core.snapshot import parse_snapshot

GIB = 1024**3
Doc = dict[str, Any]


def node(name: str, gpus: int = 8, cpu: float = 64_000, mem: float = 512 * GIB, **extra: Any) -> Doc:
    return {"name": name, "gpus": gpus, "cpuMilli": cpu, "memBytes": mem, **extra}


def queue(
    name: str,
    parent: str | None = None,
    quota: float = -1,
    limit: float = -1,
    weight: float = 1,
    priority: int = 100,
    **extra: Any,
) -> Doc:
    return {
        "name": name,
        "parent": parent,
        "priority": priority,
        "gpu": {"quota": quota, "limit": limit, "overQuotaWeight": weight},
        **extra,
    }


def pod(
    name: str,
    gpus: float = 1,
    node: str | None = None,
    status: str | None = None,
    cpu: float = 1000,
    mem: float = GIB,
    **extra: Any,
) -> Doc:
    return {
        "name": name,
        "gpus": gpus,
        "cpuMilli": cpu,
        "memBytes": mem,
        "node": node,
        "status": status or ("Running" if node else "Pending"),
        **extra,
    }


def job(
    name: str,
    queue: str,
    pods: list[Doc],
    priority: int = 50,
    min_member: int | None = None,
    created: str = "2025-01-01T00:00:00Z",
    preemptible: bool | None = None,
) -> Doc:
    return {
        "name": name,
        "queue": queue,
        "priority": priority,
        "preemptible": priority < 100 if preemptible is None else preemptible,
        "minMember": len(pods) if min_member is None else min_member,
        "createdAt": created,
        "pods": pods,
    }


def gang(name: str, queue: str, size: int, gpus: float = 1, node: str | None = None, **kw: Any) -> Doc:
    return job(name, queue, [pod(f"{name}-{i}", gpus, node) for i in range(size)], **kw)


def doc(nodes: list[Doc], queues: list[Doc], jobs: list[Doc], **config: str) -> Doc:
    out: Doc = {"nodes": nodes, "queues": queues, "jobs": jobs}
    if config:
        out["config"] = {"placement": config}
    return out


def cycle(document: Doc, actions: str = "allocate,consolidate,reclaim,preempt") -> CycleResult:
    return run_cycle(parse_snapshot(document), actions.split(","))


def placed(result: CycleResult, prefix: str, action: str = "bind") -> list[str]:
    """Pods whose name starts with `prefix` that got `action`."""
    return sorted(n for n, d in result.pods.items() if n.startswith(prefix) and d.action == action)
