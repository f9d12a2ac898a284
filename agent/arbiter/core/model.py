"""A cluster snapshot as frozen data: what the arbiter decides over.

Units: GPUs are counted in milli-GPUs (1000 = one device) so fractional sharing adds up exactly; CPU in
millicores; memory in bytes. Queue quantities use the same units (a queue's GPU quota of 2.5 is 2500 here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

RESOURCES = ("gpu", "cpu", "memory")
GPU, CPU, MEMORY = 0, 1, 2
UNLIMITED = -1.0  # quota: the whole level; limit: none; overQuotaWeight: served before any weighted queue
MILLI = 1000  # milli-GPUs per GPU
NON_PREEMPTIBLE_PRIORITY = 100  # KAI: priority classes at or above this are never victims

Policy = Literal["binpack", "spread"]
GpuPolicy = Literal["fgd", "binpack", "spread"]  # fgd: least fragmentation growth (fragments.py), then packing
GPU_POLICIES: tuple[str, ...] = get_args(GpuPolicy)
CPU_POLICIES: tuple[str, ...] = get_args(Policy)
PodStatus = Literal["Running", "Pending", "Releasing"]
Vector = tuple[float, float, float]  # (gpu milli, cpu milli, memory bytes)


@dataclass(frozen=True, slots=True)
class ResourceTerms:
    """One queue's terms for one resource (KAI `spec.resources.<r>`)."""

    quota: float = UNLIMITED
    limit: float = UNLIMITED
    over_quota_weight: float = 1.0


@dataclass(frozen=True, slots=True)
class QueueSpec:
    name: str
    parent: str | None
    priority: int
    terms: tuple[ResourceTerms, ResourceTerms, ResourceTerms]  # gpu, cpu, memory
    # KAI's minruntime: a job running for less than this (seconds) is no victim; None: inherit from the parent
    preempt_min_runtime: float | None = None
    reclaim_min_runtime: float | None = None


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    gpus: int
    cpu_milli: float
    mem_bytes: float
    gpu_model: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    nvlink_domains: tuple[tuple[int, ...], ...] = ()
    # what is free of its other resources (pods, ephemeral-storage, hugepages-*, extended resources), checked
    # only for pods that ask for them: a resource it does not list, it does not have
    other: Mapping[str, float] = field(default_factory=dict)
    # the multi-node NVLink fabric clique whose IMEX channels the node offers (a complete, undegraded fabric);
    # None: it offers none
    clique: str | None = None


@dataclass(frozen=True, slots=True)
class PodSpec:
    name: str
    gpu_milli: int  # a multiple of 1000 (whole GPUs) or below 1000 (a share of one GPU)
    cpu_milli: float
    mem_bytes: float
    status: PodStatus = "Pending"
    node: str | None = None
    gpu_index: int | None = None  # the GPU a running fractional pod shares
    task_priority: int = 0
    # the nodes its rules allow (nodeSelector, node affinity, tolerations: worked out by whoever reads the pod,
    # against the nodes' labels and taints); None: every node
    allowed_nodes: frozenset[str] | None = None
    other: Mapping[str, float] = field(default_factory=dict)  # what it asks of a node's other resources

    @property
    def request(self) -> Vector:
        return (float(self.gpu_milli), self.cpu_milli, self.mem_bytes)

    @property
    def fractional(self) -> bool:
        return 0 < self.gpu_milli < MILLI


@dataclass(frozen=True, slots=True)
class JobSpec:
    name: str
    queue: str
    priority: int
    preemptible: bool
    min_member: int
    created_at: float  # seconds since the epoch
    pods: tuple[PodSpec, ...]
    started_at: float | None = None  # when it last started running (min-runtime protection counts from here)
    preemption_delay: float = 0.0  # seconds it must have been pending before it may evict anyone
    pending_since: float | None = None  # when it last became pending (None: since created_at)
    # when its scheduler first saw it waiting, to the sub-second (evict.same_burst); None: created_at
    weighed_since: float | None = None
    # its pods share a ComputeDomain: all of them run on nodes of one clique (NodeSpec.clique), or none does
    one_clique: bool = False


@dataclass(frozen=True, slots=True)
class Placement:
    gpu: GpuPolicy = "fgd"
    cpu: Policy = "binpack"


@dataclass(frozen=True, slots=True)
class Fairness:
    """Time-aware fair share: each queue's normalised past usage (0..1 per resource, parents included) and
    KAI's kValue, how strongly usage shifts the over-quota division."""

    usage: Mapping[str, Vector] = field(default_factory=dict)
    k_value: float = 1.0


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[NodeSpec, ...]
    queues: tuple[QueueSpec, ...]
    jobs: tuple[JobSpec, ...]
    placement: Placement = Placement()
    fairness: Fairness = Fairness()
    now: float | None = None  # seconds since the epoch; None: no clock, so no time-based protection applies
