"""Prometheus metrics of the node agent, in a registry of their own so tests can read them in isolation."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Prepare is on the pod start path: buckets resolve the sub-millisecond to multi-second range.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class NodeMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.prepare_seconds = Histogram(
            "gpu_dra_prepare_duration_seconds",
            "Time to handle one NodePrepareResources or NodeUnprepareResources call.",
            ["operation"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prepared_claims = Gauge(
            "gpu_dra_prepared_claims", "Claims currently prepared on this node.", registry=self.registry
        )
        self.errors = Counter(
            "gpu_dra_claim_errors_total",
            "Claims whose prepare or unprepare failed.",
            ["operation"],
            registry=self.registry,
        )
        self.published_devices = Gauge(
            "gpu_dra_published_devices", "Devices in this node's ResourceSlices.", registry=self.registry
        )
        self.unhealthy_devices = Gauge(
            "gpu_dra_unhealthy_devices",
            "Devices withheld from slices after a critical NVML event.",
            registry=self.registry,
        )
        self.world_writable_driver_files = Gauge(
            "gpu_dra_driver_files_world_writable",
            "Driver libraries, binaries and firmware files every container mounts that any host user may write.",
            registry=self.registry,
        )
        self.fenced_claim_records = Gauge(
            "gpu_dra_fenced_claim_records",
            "Claim checkpoint records that cannot be trusted: their claims fenced, their devices held.",
            registry=self.registry,
        )
        self.publish_errors = Counter(
            "gpu_dra_publish_errors_total", "Failed attempts to publish ResourceSlices.", registry=self.registry
        )
