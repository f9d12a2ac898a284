"""The node agent: discovery, ResourceSlice publishing, the kubelet plugin and metrics, started and stopped as one.

Start order matters: the claim checkpoint is repaired before the kubelet can call us, and slices are
published before we register, so the scheduler never sees devices we cannot prepare.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.claims.preparer import ClaimPreparer
from agent.claims.types import ClaimRef, Preparer, PrepareResult
from agent.devices.model import Inventory
from agent.kube.claims import KubeClaimSource
from agent.kube.client import api_client
from agent.kube.nodes import node_uid
from agent.kubelet.health import DeviceHealth, Health, HealthSource
from agent.kubelet.plugin import KubeletPlugin
from agent.metrics import NodeMetrics
from agent.nvml.source import NvmlSource
from agent.slices.build import pool_content
from agent.slices.publisher import Publisher, PublishResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeConfig:
    node_name: str
    driver_name: str
    kubelet_root: Path
    cdi_root: Path
    state_dir: Path
    kubeconfig: str | None = None
    partitionable: bool = False
    resync_interval_s: float = 30.0
    liveness_address: str | None = None


class MeasuredPreparer:
    """Wraps a Preparer with the prepare latency histogram, the error counter and the prepared-claims gauge."""

    def __init__(self, inner: Preparer, metrics: NodeMetrics, prepared: set[str]) -> None:
        self._inner = inner
        self._metrics = metrics
        self._prepared = set(prepared)  # claim uids; kept here so the gauge costs no checkpoint read
        metrics.prepared_claims.set(len(self._prepared))

    def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        with self._metrics.prepare_seconds.labels("prepare").time():
            results = self._inner.prepare(claims)
        failed = {uid for uid, r in results.items() if r.error}
        self._update("prepare", failed, added=set(results) - failed)
        return results

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        with self._metrics.prepare_seconds.labels("unprepare").time():
            errors = self._inner.unprepare(claims)
        failed = {uid for uid, e in errors.items() if e}
        self._update("unprepare", failed, removed=set(errors) - failed)
        return errors

    def _update(
        self, operation: str, failed: set[str], added: Set[str] = frozenset(), removed: Set[str] = frozenset()
    ) -> None:
        if failed:
            self._metrics.errors.labels(operation).inc(len(failed))
        self._prepared |= added
        self._prepared -= removed
        self._metrics.prepared_claims.set(len(self._prepared))


class NodeAgent:
    """One node's agent over an open NVML source; `run()` blocks until `stop()` (e.g. from SIGTERM)."""

    def __init__(
        self, config: NodeConfig, nvml: NvmlSource, metrics: NodeMetrics | None = None, api: Any = None
    ) -> None:
        self.config = config
        self.metrics = metrics or NodeMetrics()
        self._nvml = nvml
        self._api = api if api is not None else api_client(config.kubeconfig)
        self._stop = threading.Event()
        self._discovery_lock = threading.Lock()
        self._inventory = self._discover()
        self.health = HealthSource()
        self._publisher = Publisher(
            self._api,
            config.node_name,
            config.driver_name,
            partitionable=config.partitionable,
            node_uid=node_uid(self._api, config.node_name),
        )
        self._preparer = ClaimPreparer(
            node_name=config.node_name,
            driver_name=config.driver_name,
            state_dir=config.state_dir,
            cdi_root=config.cdi_root,
            source=KubeClaimSource(self._api),
            inventory=lambda: self._inventory,
            is_healthy=self._is_healthy,
        )
        self.plugin: KubeletPlugin | None = None
        self._threads: list[threading.Thread] = []

    @property
    def inventory(self) -> Inventory:
        return self._inventory

    @property
    def preparer(self) -> Preparer:
        return self._preparer

    def start(self) -> None:
        recovery = self._preparer.recover()
        log.info("claim checkpoint ready", extra={"recovery": str(recovery)})
        self._record_health(self._inventory)
        self._on_published(self._publisher.publish(self._inventory))
        measured = MeasuredPreparer(self._preparer, self.metrics, set(self._preparer.states.load().claims))
        self.plugin = KubeletPlugin(
            self.config.driver_name,
            self.config.kubelet_root,
            measured,
            self.health,
            liveness_address=self.config.liveness_address,
        )
        self.plugin.start()
        self._spawn("slice-resync", self._resync_loop)

    def run(self) -> None:
        self.start()
        try:
            self._stop.wait()
        finally:
            self.shutdown()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Stop serving and remove the sockets. Slices stay: a restarting agent keeps its pool visible."""
        self._stop.set()
        if self.plugin is not None:
            self.plugin.stop()
        for t in self._threads:
            t.join(timeout=5)
        log.info("node agent stopped")

    # --- internals -------------------------------------------------------------------------------------

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _discover(self) -> Inventory:
        with self._discovery_lock:
            return self._nvml.discover()

    def _refresh(self) -> Inventory:
        """Re-discover so MIG changes made by other tools reach the slices; keep the old view on failure."""
        try:
            inventory = self._discover()
        except Exception:
            log.exception("re-discovering GPUs failed; keeping the previous inventory")
            return self._inventory
        if inventory != self._inventory:
            log.info("GPU inventory changed", extra={"gpus": len(inventory.gpus), "mig": len(inventory.mig_devices)})
            self._inventory = inventory
            self._record_health(inventory)
        return inventory

    def _resync_loop(self) -> None:
        self._publisher.run(
            self._stop,
            self._refresh,
            self.config.resync_interval_s,
            on_result=self._on_published,
            on_error=lambda exc: self.metrics.publish_errors.inc(),
        )

    def _on_published(self, result: PublishResult) -> None:
        self.metrics.published_devices.set(result.devices)

    def _record_health(self, inventory: Inventory) -> None:
        now = int(time.time())
        pool = self.config.node_name
        known = {(d.pool, d.device): d for d in self.health.snapshot().devices}
        self.health.replace(
            known.get((pool, name)) or DeviceHealth(pool, name, Health.HEALTHY, now)
            for content in pool_content(inventory, partitionable=self._publisher.partitionable)
            for name in (d["name"] for d in content.devices)
        )

    def _is_healthy(self, device_name: str) -> bool:
        return all(
            d.health is not Health.UNHEALTHY for d in self.health.snapshot().devices if d.device == device_name
        )
