"""Metrics the arbiter exports: names, help and labels here; serving them over HTTP is wired elsewhere.

`cycle_values` computes every value from a cycle result (pure, testable); `ArbiterMetrics.record` puts them
into prometheus_client collectors on a registry of the caller's choosing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter

from agent.arbiter.core.cycle import CycleResult, fair_share_in_units
from agent.arbiter.core.model import RESOURCES

QUEUE_DEPTH = "gpu_arbiter_queue_depth"
TIME_TO_ADMISSION = "gpu_arbiter_time_to_admission_seconds"
FAIR_SHARE = "gpu_arbiter_fair_share"
ALLOCATED = "gpu_arbiter_allocated"
PREEMPTIONS = "gpu_arbiter_preemptions_total"
RECLAIMS = "gpu_arbiter_reclaims_total"
CONSOLIDATIONS = "gpu_arbiter_consolidation_moves_total"
CYCLE_DURATION = "gpu_arbiter_cycle_duration_seconds"
USAGE = "gpu_arbiter_queue_usage"
PROTECTED = "gpu_arbiter_protected_jobs"
DOUBLE_ALLOCATED = "gpu_arbiter_double_allocated_devices"
UNBINDABLE = "gpu_arbiter_unbindable_pods"

# waits from seconds to days: gangs can queue for a long time
ADMISSION_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 24 * 3600)
CYCLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True, slots=True)
class CycleValues:
    """Everything one cycle contributes to the exported metrics, in the snapshot's units (GPUs as devices)."""

    queue_depth: Mapping[str, int]  # leaf queue -> jobs waiting (pending pods or below minMember)
    fair_share: Mapping[tuple[str, str], float]  # (queue, resource) -> fair share
    allocated: Mapping[tuple[str, str], float]  # (queue, resource) -> held by running, bound, pipelined pods
    preemptions: Mapping[str, int]  # victim queue -> pods evicted by preempt this cycle
    reclaims: Mapping[str, int]  # victim queue -> pods evicted by reclaim this cycle
    consolidation_moves: Mapping[str, int]  # queue -> pods moved by consolidation this cycle
    admission_waits: tuple[tuple[str, float], ...]  # (queue, seconds from creation to admission)
    cycle_seconds: float
    usage: Mapping[tuple[str, str], float] = field(default_factory=dict)  # (queue, resource) -> 0..1
    protected: Mapping[tuple[str, str], int] = field(default_factory=dict)  # (queue, protection) -> jobs


def cycle_values(result: CycleResult, now: float, cycle_seconds: float) -> CycleValues:
    """Metric values from one cycle; `now` (epoch seconds) is when its admissions happened."""
    by_cause: dict[str, Counter[str]] = {"preempt": Counter(), "reclaim": Counter(), "consolidate": Counter()}
    for eviction in result.evictions:
        by_cause[eviction.cause][eviction.queue] += 1
    return CycleValues(
        queue_depth=dict(result.pending_jobs),
        fair_share=_per_resource(result.fair_share),
        allocated=_per_resource(result.allocated),
        preemptions=dict(by_cause["preempt"]),
        reclaims=dict(by_cause["reclaim"]),
        consolidation_moves=dict(by_cause["consolidate"]),
        admission_waits=tuple((a.queue, max(0.0, now - a.created_at)) for a in result.admissions),
        cycle_seconds=cycle_seconds,
        usage={(q, r): v for q, vector in result.usage.items() for r, v in zip(RESOURCES, vector, strict=True)},
        protected=dict(result.protected),
    )


def _per_resource(vectors: Mapping[str, tuple[float, float, float]]) -> dict[tuple[str, str], float]:
    return {(q, r): v for q, vector in vectors.items() for r, v in fair_share_in_units(vector).items()}


class ArbiterMetrics:
    """The arbiter's collectors, registered on `registry` (a fresh one per test; the default in the service)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queue_depth = Gauge(
            QUEUE_DEPTH,
            "Jobs waiting in a leaf queue (pending pods or gang below minMember).",
            ["queue"],
            registry=registry,
        )
        self.time_to_admission = Histogram(
            TIME_TO_ADMISSION,
            "Seconds from a job's creation until its gang was admitted (every member bound).",
            ["queue"],
            buckets=ADMISSION_BUCKETS,
            registry=registry,
        )
        self.fair_share = Gauge(
            FAIR_SHARE,
            "Fair share of a queue this cycle (gpu: devices, cpu: millicores, memory: bytes).",
            ["queue", "resource"],
            registry=registry,
        )
        self.allocated = Gauge(
            ALLOCATED,
            "Resources a queue holds after this cycle (same units as fair share).",
            ["queue", "resource"],
            registry=registry,
        )
        self.preemptions = PromCounter(
            PREEMPTIONS, "Pods evicted by preemption inside their queue.", ["queue"], registry=registry
        )
        self.reclaims = PromCounter(
            RECLAIMS, "Pods evicted from a queue above its fair share by another queue.", ["queue"], registry=registry
        )
        self.consolidation_moves = PromCounter(
            CONSOLIDATIONS, "Pods moved to defragment nodes.", ["queue"], registry=registry
        )
        self.usage = Gauge(
            USAGE,
            "Time-aware fair share: a queue's decayed past usage as a share of the cluster (0..1).",
            ["queue", "resource"],
            registry=registry,
        )
        self.protected = Gauge(
            PROTECTED,
            "Jobs a protection shields this cycle (preemptMinRuntime, "
            "reclaimMinRuntime: too young to be victims; preemptionDelay: may not evict yet).",
            ["queue", "protection"],
            registry=registry,
        )
        self.double_allocated = Gauge(
            DOUBLE_ALLOCATED,
            "Devices of the driver allocated to two or more ResourceClaims at once (each claim gets a Warning Event).",
            registry=registry,
        )
        self.unbindable = Gauge(
            UNBINDABLE,
            "Admitted pods kube-scheduler has refused to bind, for a while, to the "
            "node the arbiter placed them on (each gets a Warning Event in its words).",
            registry=registry,
        )
        self.cycle_duration = Histogram(
            CYCLE_DURATION,
            "Seconds one arbiter cycle took, snapshot to decisions.",
            buckets=CYCLE_BUCKETS,
            registry=registry,
        )

    def record(self, values: CycleValues) -> None:
        for queue, depth in values.queue_depth.items():
            self.queue_depth.labels(queue=queue).set(depth)
        for (queue, resource), v in values.fair_share.items():
            self.fair_share.labels(queue=queue, resource=resource).set(v)
        for (queue, resource), v in values.allocated.items():
            self.allocated.labels(queue=queue, resource=resource).set(v)
        for counter, counts in (
            (self.preemptions, values.preemptions),
            (self.reclaims, values.reclaims),
            (self.consolidation_moves, values.consolidation_moves),
        ):
            for queue, n in counts.items():
                counter.labels(queue=queue).inc(n)
        for (queue, resource), v in values.usage.items():
            self.usage.labels(queue=queue, resource=resource).set(v)
        self.protected.clear()  # a protection that ended must not linger
        for (queue, protection), n in values.protected.items():
            self.protected.labels(queue=queue, protection=protection).set(n)
        for queue, wait in values.admission_waits:
            self.time_to_admission.labels(queue=queue).observe(wait)
        self.cycle_duration.observe(values.cycle_seconds)
