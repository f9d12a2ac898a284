"""Which API objects the arbiter can weigh, and why the others are left out: pure.

No single object stops the cycle. A Queue, PodGroup, pod or claim the arbiter cannot read is left out of the
snapshot with a reason, which the controller reports on that object (a Warning Event; a Queue also on its
`Valid` status condition), and everything else goes on. The Queue CRD's schema refuses bad values when a
Queue is written; the checks here cover what a schema cannot (a parent that exists, no cycle in the tree) and
Queues stored before the schema said so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.arbiter.core.model import MILLI, UNLIMITED, QueueSpec, ResourceTerms
from agent.arbiter.core.snapshot import go_duration

MB = 1_000_000
_SCALES = (("gpu", float(MILLI)), ("cpu", 1.0), ("memory", float(MB)))  # spec units -> the core's
_DEFAULTS = (("quota", 0.0), ("limit", UNLIMITED), ("overQuotaWeight", 1.0))


@dataclass(frozen=True)
class Invalid:
    """An object left out of this cycle's snapshot, and why (one sentence, for an Event and a condition)."""

    kind: str  # Queue, PodGroup, Pod, ResourceClaim
    obj: Mapping[str, Any]
    reason: str

    @property
    def key(self) -> str:
        m = self.obj.get("metadata") if isinstance(self.obj, dict) else None
        m = m if isinstance(m, dict) else {}
        ns = m.get("namespace")
        return f"{self.kind} {ns}/{m.get('name')}" if ns else f"{self.kind} {m.get('name')}"


class _Bad(ValueError):
    pass


def _number(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Bad(f"{what} must be a number, not {value!r}")
    number = float(value)
    if not math.isfinite(number):
        raise _Bad(f"{what} must be finite, not {value!r}")
    return number


def _terms(resources: Mapping[str, Any], resource: str, scale: float) -> ResourceTerms:
    block = resources.get(resource)
    if block is None:
        block = {}
    if not isinstance(block, dict):
        raise _Bad(f"spec.resources.{resource} must be an object")
    values = {}
    for key, default in _DEFAULTS:
        raw = block.get(key)
        value = default if raw is None else _number(raw, f"spec.resources.{resource}.{key}")
        if key == "overQuotaWeight":
            if value < 0:
                raise _Bad(f"spec.resources.{resource}.overQuotaWeight must be 0 or more, not {raw!r}")
        elif value != UNLIMITED:
            if value < 0:
                raise _Bad(f"spec.resources.{resource}.{key} must be -1 (unlimited) or 0 or more, not {raw!r}")
            value *= scale
        values[key] = value
    return ResourceTerms(quota=values["quota"], limit=values["limit"], over_quota_weight=values["overQuotaWeight"])


def queue_spec(obj: Mapping[str, Any]) -> QueueSpec:
    """A Queue object (KAI v2 fields) as the core's QueueSpec; `ValueError` names the first bad field."""
    if not isinstance(obj, dict):
        raise _Bad("the Queue is not an object")
    metadata = obj.get("metadata") or {}
    name = metadata.get("name") if isinstance(metadata, dict) else None
    if not isinstance(name, str) or not name:
        raise _Bad("the Queue has no name")
    spec = obj.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        raise _Bad("spec must be an object")
    resources = spec.get("resources")
    if resources is None:
        resources = {}
    if not isinstance(resources, dict):
        raise _Bad("spec.resources must be an object")
    gpu, cpu, memory = (_terms(resources, r, scale) for r, scale in _SCALES)
    parent = spec.get("parentQueue") or None
    if parent is not None and not isinstance(parent, str):
        raise _Bad(f"spec.parentQueue must be a queue name, not {parent!r}")
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        raise _Bad(f"spec.priority must be an integer, not {priority!r}")
    runtimes = []
    for key in ("preemptMinRuntime", "reclaimMinRuntime"):
        raw = spec.get(key)
        seconds = go_duration(raw)
        if raw not in (None, "") and seconds is None:
            raise _Bad(f'spec.{key} must be a Go duration such as "5m", not {raw!r}')
        runtimes.append(seconds)
    return QueueSpec(
        name=name,
        parent=parent,
        priority=priority if priority is not None else 100,
        terms=(gpu, cpu, memory),
        preempt_min_runtime=runtimes[0],
        reclaim_min_runtime=runtimes[1],
    )


def valid_queues(objs: Iterable[Mapping[str, Any]]) -> tuple[list[QueueSpec], dict[str, Invalid]]:
    """The Queues the arbiter can weigh, in input order, and the rest by name with the reason: a bad field, a
    parent that does not exist or is itself left out, or a cycle in the tree."""
    specs: dict[str, QueueSpec] = {}
    objects: dict[str, Mapping[str, Any]] = {}
    invalid: dict[str, Invalid] = {}
    for obj in objs:
        try:
            spec = queue_spec(obj)
        except ValueError as e:
            bad = Invalid("Queue", obj, f"invalid Queue: {e}")
            invalid[bad.key.removeprefix("Queue ")] = bad
            continue
        specs[spec.name] = spec
        objects[spec.name] = obj
    for name, spec in specs.items():
        seen = [name]
        parent = spec.parent
        while parent is not None and parent in specs and parent not in seen:
            seen.append(parent)
            parent = specs[parent].parent
        if parent == name:  # back where it started: a queue on the cycle (one below it is left out below)
            invalid[name] = Invalid(
                "Queue", objects[name], f"invalid Queue: the parentQueue chain {' -> '.join([*seen, name])} is a cycle"
            )
    # a missing parent (or one left out) leaves out the whole branch below it, top-down
    changed = True
    while changed:
        changed = False
        for name, spec in specs.items():
            if name in invalid or spec.parent is None:
                continue
            if spec.parent not in specs:
                reason = f"invalid Queue: its parentQueue {spec.parent} does not exist"
            elif spec.parent in invalid:
                reason = f"invalid Queue: its parentQueue {spec.parent} is invalid"
            else:
                continue
            invalid[name] = Invalid("Queue", objects[name], reason)
            changed = True
    return [s for n, s in specs.items() if n not in invalid], invalid


def pod_group_problem(group: Mapping[str, Any]) -> str | None:
    """Why a PodGroup cannot define a gang (None when it can)."""
    spec = group.get("spec")
    if spec is None:
        spec = {}
    if not isinstance(spec, dict):
        return "spec must be an object"
    policy = spec.get("schedulingPolicy")
    if policy is not None and not isinstance(policy, dict):
        return "spec.schedulingPolicy must be an object"
    gang = (policy or {}).get("gang")
    if gang is not None and not isinstance(gang, dict):
        return "spec.schedulingPolicy.gang must be an object"
    count = (gang or {}).get("minCount")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        return f"spec.schedulingPolicy.gang.minCount must be a whole number of at least 1, not {count!r}"
    priority = spec.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int)):
        return f"spec.priority must be an integer, not {priority!r}"
    return None
