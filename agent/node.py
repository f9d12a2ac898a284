"""The node agent: discovery, ResourceSlice publishing, the kubelet plugin and metrics, started and stopped as one.

Start order matters: the claim checkpoint is repaired before the kubelet can call us, and slices are
published before we register, so the scheduler never sees devices we cannot prepare.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.sharing import ClaimSharing
from agent.claims.state import holders
from agent.claims.types import ClaimRef, Preparer, PrepareResult
from agent.devices.fabric import broken_devices, fabric_reason
from agent.devices.model import Gpu, Inventory
from agent.devices.names import GpuName, InvalidDeviceName, gpu_device_name, parse_device_name
from agent.devices.shares import ShareMode
from agent.driver.startup import log_setup, set_up
from agent.jsontypes import Json
from agent.kube.claims import KubeClaimSource, allocated_in_pool
from agent.kube.errors import ApiError, NotFound
from agent.kube.events import EventRecorder
from agent.kube.kubeconfig import connect
from agent.kube.node_status import COMPONENT, NodeStatus, node_labels
from agent.kube.nodes import NodeInfo, NodeWatcher, node_uid
from agent.kube.rest import Rest
from agent.kube.slices import watch_changes
from agent.kubelet.health import DeviceHealth, Health, HealthSource
from agent.kubelet.plugin import KubeletPlugin
from agent.metrics import NodeMetrics
from agent.migconfig.reconciler import MigReconciler, NodeHooks
from agent.migconfig.reset import reset_gpu
from agent.migconfig.spec import MigConfigs
from agent.names import ARBITER_USER, RESERVATION_AUDIENCE
from agent.nvml.health import HealthMonitor, device_taint, parent_gpu_name, with_gpus_kept, without_devices
from agent.nvml.migctl import MigControl
from agent.nvml.migmode import MigReconfiguration
from agent.nvml.source import NvmlSource
from agent.sharing.commands import DriverRoot, SubprocessRunner
from agent.sharing.control import SharingControl
from agent.slices.build import pool_content
from agent.slices.publisher import Publisher, PublishResult
from agent.slices.taints import fabric_taint
from agent.slices.versions import LATEST, SliceRules, rules_for

if TYPE_CHECKING:
    from agent.computedomain.plugin import ComputeDomainPlugin
    from agent.reservation.node_service import NodeReservations

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
    share_mode: ShareMode | None = None  # --consumable-shares: whole GPUs shareable by many claims
    resync_interval_s: float = 30.0
    liveness_address: str | None = None
    health_events: bool = True  # watch NVML for critical XIDs and lost GPUs
    extra_ignored_xids: frozenset[int] = frozenset()  # beyond the application XIDs always ignored
    driver_root: Path = Path("/")  # the NVIDIA driver's root as the agent sees it (its files, nvidia-smi)
    host_driver_root: str = "/"  # the same root as the container runtime on the host sees it (CDI hostPaths)
    nvidia_cdi_hook_path: str | None = None  # host path of nvidia-cdi-hook; None: NVIDIA's install paths
    dev_root: Path = Path("/")  # where the host's /dev/nvidia* nodes are (the CDI specs' hostPath beneath it)
    reservation_address: str | None = None  # HOST:PORT for the arbiter's reservation API; None: not served
    reservation_audience: str = RESERVATION_AUDIENCE  # the arbiter's token is for it (TokenReview)
    arbiter_user: str = ARBITER_USER  # the one user that may reserve devices
    node_ip: str | None = None  # advertised instead of 0.0.0.0
    mig_configs: MigConfigs | None = None  # follow the nvidia.com/mig.config label with these; None: ignore it
    mps_watch_interval_s: float = 2.0  # how often the MPS daemons of prepared claims are checked (their pids)
    # where the arbiter's Lease is: while no arbiter holds it, one node agent tells the pods that wait for it
    # (agent.absent_arbiter); None: never
    arbiter_namespace: str | None = None
    absent_arbiter_period_s: float = 60.0
    # --no-gpus: no gpu.nvidia.com (slices, kubelet plugin, MIG, reservations); GPUs are still discovered, for
    # their fabric clique. Only with compute_domains.
    gpus: bool = True
    # --compute-domains: also serve compute-domain.nvidia.com (IMEX channels, the domains' IMEX daemons)
    compute_domains: bool = False
    imex_address: str = ""  # where this node's IMEX daemons listen (the pod's IP): status.nodes[].ipAddress
    proc_devices: Path = Path("/proc/devices")  # its nvidia-caps-imex-channels line: the channels' major
    imex_channel_count: int = 2048


class MeasuredPreparer:
    """Wraps a Preparer with the prepare latency histogram, the error counter and the prepared-claims gauge."""

    def __init__(self, inner: Preparer, metrics: NodeMetrics, prepared: set[str]) -> None:
        self._inner = inner
        self._metrics = metrics
        self._prepared = set(prepared)  # claim uids; kept here so the gauge costs no checkpoint read
        self._lock = threading.Lock()
        metrics.prepared_claims.set(len(self._prepared))

    def prepare(self, claims: Sequence[ClaimRef], timeout: float | None = None) -> dict[str, PrepareResult]:
        with self._metrics.prepare_seconds.labels("prepare").time():
            results = self._inner.prepare(claims, timeout=timeout)
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
        with self._lock:  # prepare and unprepare may run at once
            self._prepared |= added
            self._prepared -= removed
            self._metrics.prepared_claims.set(len(self._prepared))


class NodeAgent:
    """One node's agent over an open NVML source; `run()` blocks until `stop()` (e.g. from SIGTERM)."""

    def __init__(
        self, config: NodeConfig, nvml: NvmlSource, metrics: NodeMetrics | None = None, rest: Rest | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics or NodeMetrics()
        self._nvml = nvml
        self._rest = rest if rest is not None else connect(config.kubeconfig)
        self._stop = threading.Event()
        self._discovery_lock = threading.Lock()  # discover and swap together (_refresh)
        self._inventory = nvml.discover()
        # The driver's files every claim's CDI spec carries, found once (DriverVersionMismatch: wrong root).
        self.driver = set_up(
            config.driver_root, config.host_driver_root, self._inventory.driver_version, config.nvidia_cdi_hook_path
        )
        log_setup(self.driver)
        self.metrics.world_writable_driver_files.set(len(self.driver.files.world_writable))
        self.health = HealthSource()
        self._health_lock = threading.Lock()  # orders event updates against re-recording after discovery
        self._unhealthy: dict[str, str] = {}  # device name -> reason; kept until the agent restarts
        self._taints: dict[str, list[Json]] = {}  # device name -> its device taints (published on 1.36+)
        # device name -> (its GPU's NVLink fabric fault, since when): follows discovery, clears on recovery
        self._fabric: dict[str, tuple[str, float]] = {}
        self._track_fabric(self._inventory)
        self._seen_gpus = {g.minor: g for g in self._inventory.gpus}  # a lost GPU stays listed, tainted
        self._health_changed = threading.Event()  # wakes the publish thread: health or MIG devices changed
        self._monitor: HealthMonitor | None = None
        rules = self._read_slice_rules()  # None while the API is away: the publisher reads it before writing
        self._node_uid = self._read_node_uid()
        self._publisher = Publisher(
            self._rest,
            config.node_name,
            config.driver_name,
            partitionable=config.partitionable,
            node_uid=self._node_uid,
            rules=rules,
            taints=self._device_taints,
            share_mode=config.share_mode,
        )
        # The Node's uid owns the slices; watched, because a Node deleted and created again has a new one.
        self._node = NodeWatcher(self._rest, config.node_name)
        self._node.subscribe(self._on_node_changed)
        # Slices deleted behind our back (an API server that lost its store) come back at once.
        self._slice_watch = watch_changes(self._rest, config.node_name, config.driver_name, self._on_slices_changed)
        self._withheld: frozenset[int] = frozenset()  # GPU minors a MIG reconfiguration keeps out of the slices
        self._preparer = ClaimPreparer(
            PrepareSettings(
                node_name=config.node_name,
                driver_name=config.driver_name,
                inventory=lambda: self._inventory,
                is_healthy=lambda name: self._healthy_by_events(name) and not self._reconfiguring(name),
                migs=MigControl(),  # creates the MIG placements claims are allocated, destroys them after
                on_inventory_changed=self._on_inventory_changed,
                sharing=ClaimSharing(
                    SharingControl(SubprocessRunner(DriverRoot(config.driver_root)), config.state_dir)
                ),
                reserved=self._reserved_for_other,
                share_mode=config.share_mode,
                dev_root=config.dev_root,
            ),
            state_dir=config.state_dir,
            cdi_root=config.cdi_root,
            driver_edits=self.driver.edits,
            source=KubeClaimSource(self._rest),
            notify=self._notify,
            on_fenced=self.metrics.fenced_claim_records.set,
        )
        self.plugin: KubeletPlugin | None = None
        self.compute_domains: ComputeDomainPlugin | None = None
        self.reservations: NodeReservations | None = None
        self._threads: list[threading.Thread] = []
        self._mig: MigReconciler | None = None
        if config.mig_configs is not None:
            self._mig = MigReconciler(
                config.mig_configs,
                MigReconfiguration(),
                NodeHooks(
                    discover=self._refresh,
                    withhold=self._withhold,
                    claims_on=self._claims_on,
                    allocated_on=self._allocated_on,
                    prepare_lock=self._preparer.lock.hold,
                    reset=self._reset_gpu,
                ),
                NodeStatus(self._rest, config.node_name, self._node_uid),
                partitionable=config.partitionable,
            )

    @property
    def inventory(self) -> Inventory:
        return self._inventory

    @property
    def node(self) -> NodeWatcher:
        """This node's Node object, watched: subscribe to hear of uid and label changes."""
        return self._node

    @property
    def preparer(self) -> Preparer:
        return self._preparer

    def start(self) -> None:
        self._events = EventRecorder(self._rest, COMPONENT, self.config.node_name)  # before anything tells of claims
        labels = self._start_gpu_driver() if self.config.gpus else None
        if not self.config.gpus:
            self._node.start()
        if self.config.compute_domains:
            self.compute_domains = self._compute_domain_plugin()
            self.compute_domains.start(self._node_uid)
        if self.config.gpus:
            self._start_gpu_services(labels)
        else:  # nothing else rediscovers: the fabric's state, which decides the channels, is read each interval
            self._spawn("fabric-watch", self._fabric_watch_loop)

    def _start_gpu_driver(self) -> dict[str, str] | None:
        """gpu.nvidia.com up to serving the kubelet: checkpoint repaired, slices published, plugin registered.
        The Node's labels as read at start (None: unread)."""
        if writable := self.driver.files.world_writable:
            self._notify(
                None,
                "Warning",
                "DriverFilesWorldWritable",
                f"{len(writable)} driver file(s) under {self.config.driver_root} that every container mounts "
                f"are writable by every user on the host: {', '.join(writable)}",
            )
        recovery = self._preparer.recover()
        log.info("claim checkpoint ready", extra={"recovery": str(recovery)})
        self._record_health(self._inventory)
        self._node.start()
        labels = self._node_labels()
        if self._mig is not None and labels is not None:
            # GPUs a MIG change still has to reach (e.g. after a crash mid-apply) never show up in between.
            self._withheld = self._mig.withheld_at_start(self._inventory, labels)
        try:
            self._on_published(self._publisher.publish(self._schedulable(self._inventory)))
        except ApiError as exc:  # the resync loop retries with backoff; the kubelet is served meanwhile
            log.warning("publishing ResourceSlices at start failed, serving the kubelet and retrying: %s", exc)
            self.metrics.publish_errors.inc()
        self._slice_watch.start(name="slice-watch")
        measured = MeasuredPreparer(self._preparer, self.metrics, set(self._preparer.states.load().claims))
        self.plugin = KubeletPlugin(
            self.config.driver_name,
            self.config.kubelet_root,
            measured,
            self.health,
            liveness_address=self.config.liveness_address,
        )
        self.plugin.start()
        return labels

    def _start_gpu_services(self, labels: dict[str, str] | None) -> None:
        """What follows the GPU driver's devices: reservations, resync, health, MPS daemons, MIG labels."""
        if self.config.reservation_address:
            # imported only when served: the allocator and its CEL library cost the daemon's start-up otherwise
            from agent.reservation.auth import TokenReviewer
            from agent.reservation.node_service import NodeReservations

            reviewer = TokenReviewer(
                self._rest, audience=self.config.reservation_audience, username=self.config.arbiter_user
            )
            self.reservations = NodeReservations(
                node_name=self.config.node_name,
                driver=self.config.driver_name,
                inventory=self._offered,
                prepared=self._preparer.holders,
                unhealthy=lambda: list(self._unhealthy_names()),
                token=reviewer,
                rest=self._rest,
                share_mode=self.config.share_mode,
            )
            self.reservations.start(self.config.reservation_address, self.config.node_ip)
        self._spawn("slice-resync", self._resync_loop)
        if self.config.health_events:
            self._monitor = HealthMonitor(
                self._with_seen_gpus, self._on_health_change, extra_ignored_xids=self.config.extra_ignored_xids
            )
            self._monitor.start()
        self._spawn("health-publish", self._health_publish_loop)
        self._spawn("mps-watch", self._mps_watch_loop)
        if self.config.arbiter_namespace:
            from agent.absent_arbiter import AbsenceTeller

            teller = AbsenceTeller(
                self._rest,
                self.config.arbiter_namespace,
                self.config.node_name,
                self._events,
                period_s=self.config.absent_arbiter_period_s,
            )
            self._spawn("absent-arbiter", lambda: teller.run(self._stop))
        if self._mig is not None:
            self._spawn("mig-reconfigure", self._mig_loop)
            if labels is not None:
                self._mig.offer(labels)
            self._node.subscribe(self._offer_labels)  # each change of nvidia.com/mig.config starts a change

    def run(self) -> None:
        try:
            self.start()
            self._stop.wait()
        finally:
            self.shutdown()  # also after a failed start: no socket or monitor thread is left behind

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        """Stop serving and remove the sockets. Slices owned by the Node stay: a restarting agent keeps its pool
        visible; slices without an owner (no such Node) are withdrawn, as nothing else would ever remove them."""
        self._stop.set()
        self._health_changed.set()  # wakes the health-publish thread to see the stop
        self._publisher.wake()  # and the resync loop
        self._node.stop()
        if self.config.gpus:
            self._slice_watch.stop()
        if self._mig is not None:
            self._mig.wake_for_stop()
        if self._monitor is not None:
            self._monitor.stop()  # before the NVML session closes
        if self.plugin is not None:
            self.plugin.stop()
        if self.compute_domains is not None:
            self.compute_domains.stop()
        if self.reservations is not None:
            self.reservations.stop()
        for t in self._threads:
            t.join(timeout=5)
        if self.config.gpus:  # after the resync loop: no publish races the withdrawal
            self._publisher.withdraw_ownerless()
        log.info("node agent stopped")

    # --- internals -------------------------------------------------------------------------------------

    def _compute_domain_plugin(self) -> ComputeDomainPlugin:
        """The second driver, for this node's fabric clique (none: it publishes nothing and prepares nothing)."""
        from agent.claims.checkpoint import read_boot_id
        from agent.computedomain.channels import node_clique
        from agent.computedomain.plugin import ComputeDomainPlugin, ComputeDomainSettings

        c = self.config
        settings = ComputeDomainSettings(
            node_name=c.node_name,
            kubelet_root=c.kubelet_root,
            cdi_root=c.cdi_root,
            state_dir=c.state_dir,
            driver_root=c.driver_root,
            ip_address=c.imex_address,
            dev_root=c.dev_root,
            proc_devices=c.proc_devices,
            channel_count=c.imex_channel_count,
            # the GPU plugin's liveness endpoint, where there is no GPU plugin
            liveness_address=None if c.gpus else c.liveness_address,
        )
        clique = node_clique([g.fabric for g in self._inventory.gpus])
        return ComputeDomainPlugin(settings, self._rest, clique, read_boot_id())

    def _notify(self, claim: ClaimRef | None, type_: str, reason: str, message: str) -> None:
        """An Event on the claim, or on this Node for None (from the claim code, under the node lock: queued)."""
        if claim is None:
            current = self._node.current
            node = {"metadata": {"name": self.config.node_name, "uid": current.uid if current else self._node_uid}}
            self._events.record(node, "Node", "v1", reason, message, type_=type_)
        else:
            obj = {"metadata": {"namespace": claim.namespace, "name": claim.name, "uid": claim.uid}}
            self._events.record(obj, "ResourceClaim", "resource.k8s.io/v1", reason, message, type_=type_)

    def _reserved_for_other(self, device_name: str, claim: str, share: bool) -> str:
        """The arbiter's reservation for another claim holding this device ("" for none): prepare refuses it."""
        reservations = self.reservations
        return reservations.book.reserved_for_other(device_name, claim, share) if reservations is not None else ""

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _refresh(self) -> Inventory:
        """Re-discover so MIG changes made by other tools reach the slices; keep the old view on failure."""
        try:
            with self._discovery_lock:  # discover and swap together: an older view never replaces a newer one
                inventory = self._nvml.discover()
                changed, self._inventory = inventory != self._inventory, inventory
                self._seen_gpus.update((g.minor, g) for g in inventory.gpus)
        except Exception:
            log.exception("re-discovering GPUs failed; keeping the previous inventory")
            return self._inventory
        if changed:
            log.info("GPU inventory changed", extra={"gpus": len(inventory.gpus), "mig": len(inventory.mig_devices)})
            if self._track_fabric(inventory):
                self._health_changed.set()
            self._record_health(inventory)
            if self.compute_domains is not None:  # a node that leaves its fabric clique withdraws its channels
                from agent.computedomain.channels import node_clique

                self.compute_domains.set_clique(node_clique([g.fabric for g in inventory.gpus]))
        return inventory

    def _fabric_watch_loop(self) -> None:
        while not self._stop.wait(self.config.resync_interval_s):
            self._refresh()

    def _on_inventory_changed(self) -> None:
        """Prepare created or destroyed a MIG device: later prepares see it at once, the slices soon."""
        self._refresh()
        self._health_changed.set()

    def _resync_loop(self) -> None:
        self._publisher.run(
            self._stop,
            lambda: self._schedulable(self._refresh()),
            self.config.resync_interval_s,
            on_result=self._on_published,
            on_error=lambda exc: self.metrics.publish_errors.inc(),
        )

    @property
    def slice_rules(self) -> SliceRules:
        """The ResourceSlice rules of the server's version. Until the API has answered /version, the newest
        release's: only the health records and the offer are shaped by them then, and nothing is published
        before the publisher has read the version."""
        return self._publisher.known_rules or LATEST

    def _read_slice_rules(self) -> SliceRules | None:
        try:
            rules = rules_for(self._rest.server_version())
        except ApiError as exc:
            log.warning("cannot read the API server's version yet, going on without it: %s", exc)
            return None
        log.info("API server is Kubernetes %s", rules.label)
        return rules

    def _read_node_uid(self) -> str | None:
        """The Node's uid at start, or None when the API is away: the Node watch (retrying with backoff)
        supplies it once the API answers, and the publisher reads it before its first write."""
        try:
            return node_uid(self._rest, self.config.node_name)  # None without a Node: the watch warns
        except ApiError as exc:
            log.warning("cannot read Node %s yet, going on without it: %s", self.config.node_name, exc)
            return None

    def _on_slices_changed(self, kind: str, name: str) -> None:
        """From the slice watch thread: a slice of ours was deleted (or the watch relisted): resync now."""
        if kind == "DELETED":
            log.info("ResourceSlice %s was deleted, checking the pool", name)
        self._publisher.wake()

    def _on_node_changed(self, node: NodeInfo) -> None:
        """From the Node watch thread: note the owner, republish from the resync loop (no API I/O here)."""
        if node.uid is None:
            log.warning(
                "there is no Node named %s: check --node-name; slices are published without an owner and "
                "withdrawn when the agent stops",
                self.config.node_name,
            )
        if self._publisher.set_node_uid(node.uid):
            self._publisher.wake()

    def _on_published(self, result: PublishResult) -> None:
        self.metrics.published_devices.set(result.devices)

    def _record_health(self, inventory: Inventory) -> None:
        """Every device of the inventory, plus those known unhealthy even if discovery no longer lists them
        (a lost GPU): the kubelet keeps reporting them to pods that hold them."""
        now = int(time.time())
        pool = self.config.node_name
        with self._health_lock:
            known = {(d.pool, d.device): d for d in self.health.snapshot().devices}
            names = {
                d["name"]
                for content in pool_content(
                    inventory, partitionable=self._publisher.partitionable, rules=self.slice_rules
                )
                for d in content.devices
            } | self._unhealthy.keys()
            fresh = (
                DeviceHealth(pool, name, Health.HEALTHY, now)
                if self._healthy_by_events(name)
                else DeviceHealth(pool, name, Health.UNHEALTHY, now, self._reason(name))
                for name in sorted(names)
            )
            self.health.replace(_kept(known.get((d.pool, d.device)), d) for d in fresh)

    def _healthy_by_events(self, device_name: str) -> bool:
        """The one record of health (the health stream is stamped from it): NVML's events and the GPUs' fabric.
        A MIG device is unhealthy with its GPU: this also covers partitionable MIG placements."""
        parent = parent_gpu_name(device_name)
        return not any(n in self._unhealthy or n in self._fabric for n in (device_name, parent) if n is not None)

    def _reason(self, device_name: str) -> str:
        """Why a device is unhealthy: its own fault, or its GPU's; an event's before the fabric's."""
        names = [n for n in (device_name, parent_gpu_name(device_name)) if n is not None]
        told = [self._unhealthy[n] for n in names if n in self._unhealthy]
        return (told or [fabric_reason(self._fabric[n][0]) for n in names if n in self._fabric] or [""])[0]

    def _unhealthy_names(self) -> set[str]:
        with self._health_lock:
            return set(self._unhealthy) | self._fabric.keys()

    def _track_fabric(self, inventory: Inventory) -> bool:
        """Follow the GPUs' fabric faults in a fresh inventory (agent.devices.fabric); a fault keeps the time it
        was first seen while it lasts. Whether anything changed."""
        broken = broken_devices(inventory)
        now = time.time()
        with self._health_lock:
            before = {name: fault for name, (fault, _) in self._fabric.items()}
            self._fabric = {n: (fault, self._fabric.get(n, (fault, now))[1]) for n, fault in broken.items()}
        if broken != before:
            log.warning("NVLink fabric faults changed", extra={"faults": broken, "before": before})
        return broken != before

    def _on_health_change(self, device_name: str, healthy: bool, reason: str) -> None:
        """From the NVML monitor's thread: record it now, publish from our own thread (no API I/O here)."""
        with self._health_lock:
            if healthy:
                self._unhealthy.pop(device_name, None)
                self._taints.pop(device_name, None)
            else:
                self._unhealthy[device_name] = reason
                fault = self._monitor.fault(device_name) if self._monitor is not None else None
                self._taints[device_name] = [device_taint(fault, self.config.driver_name, time.time())]
            self.metrics.unhealthy_devices.set(len(self._unhealthy))
            state = Health.HEALTHY if healthy else Health.UNHEALTHY
            self.health.set(self.config.node_name, device_name, state, int(time.time()), "" if healthy else reason)
        self._health_changed.set()

    def _schedulable(self, inventory: Inventory) -> Inventory:
        """What the slices offer. Where the server serves device taints (1.36+) unhealthy devices stay, tainted
        (`_device_taints`), so users see why; before that they are left out, because device taints
        (DRADeviceTaints) are alpha and off by default in 1.34-1.35, where the server would silently drop the
        taint and the scheduler would keep picking the device. Prepare refuses them in any case. GPUs a MIG
        reconfiguration is changing are left out with everything carved from them."""
        unhealthy = self._unhealthy_names()
        withheld = {gpu_device_name(m) for m in self._withheld}
        if self.slice_rules.taints_served:
            return without_devices(with_gpus_kept(inventory, self._seen_gpus.values(), unhealthy), withheld)
        return without_devices(inventory, unhealthy | withheld)

    # --- MIG reconfiguration from the node label ---------------------------------------------------------

    def _node_labels(self) -> dict[str, str] | None:
        """The Node's labels, or None when they cannot be read (no Node object, API trouble)."""
        try:
            return node_labels(self._rest, self.config.node_name)
        except NotFound:
            return None
        except ApiError as exc:
            log.warning("reading node %s labels failed: %s", self.config.node_name, exc)
            return None

    def _mig_loop(self) -> None:
        if self._mig is not None:
            self._mig.run(self._stop)

    def _offer_labels(self, node: NodeInfo) -> None:
        """From the Node watch thread: the Node's labels to the MIG reconciler (it only notes them)."""
        if self._mig is not None and node.uid is not None:
            self._mig.offer(node.labels)

    def _reconfiguring(self, device_name: str) -> bool:
        """Whether the device is on a GPU a MIG reconfiguration is changing (prepare refuses it)."""
        try:
            parsed = parse_device_name(device_name)
        except InvalidDeviceName:
            return False
        return (parsed.minor if isinstance(parsed, GpuName) else parsed.parent_minor) in self._withheld

    def _offered(self) -> Inventory:
        """What the arbiter may reserve: the inventory without the GPUs a MIG reconfiguration is changing."""
        return without_devices(self._inventory, {gpu_device_name(m) for m in self._withheld})

    def _withhold(self, minors: frozenset[int]) -> None:
        """Keep these GPUs out of the slices from now on, and publish at once (a failure is retried by the
        resync loop, which publishes the same view)."""
        self._withheld = minors
        try:
            self._on_published(self._publisher.publish(self._schedulable(self._inventory)))
        except Exception:
            log.exception("publishing slices after a MIG change failed")
            self.metrics.publish_errors.inc()

    def _claims_on(self, minors: Collection[int]) -> dict[int, set[str]]:
        """What holds a device of these GPUs here: claims in the checkpoint (prepared, or being prepared) and
        the arbiter's reservations."""
        held = holders(self._preparer.states.checkpoints.peek())  # the caller may or may not hold the lock
        if self.reservations is not None:
            live = self.reservations.book.live()
            held += [(d, f"reservation of gang {r.gang_id}") for r in live for d in r.fit.all_devices]
        return _by_gpu(held, minors)

    def _allocated_on(self, minors: Collection[int]) -> dict[int, set[str]]:
        """Claims allocated a device of these GPUs in the API, prepared or not (a pod bound to this node may be
        about to start). Raises ApiError when the claims cannot be read."""
        allocated = allocated_in_pool(self._rest, self.config.driver_name, self.config.node_name)
        return _by_gpu([(d, claim) for claim, devices in allocated.items() for d in devices], minors)

    def _reset_gpu(self, gpu: Gpu) -> None:
        if self._nvml.fake is not None:
            self._nvml.fake.reset_gpu(gpu.index)  # the fake machine's `nvidia-smi -r`
        else:
            reset_gpu(gpu.pci_bus_id, self.config.driver_root)

    def _with_seen_gpus(self) -> Inventory:
        """The inventory plus GPUs discovery no longer lists: a GPU lost between rediscovery and the health probe
        must still map to its devices."""
        inventory = self._inventory
        return with_gpus_kept(inventory, self._seen_gpus.values(), {gpu_device_name(m) for m in self._seen_gpus})

    def _device_taints(self) -> dict[str, list[Json]]:
        driver = self.config.driver_name
        with self._health_lock:
            out = {name: list(taints) for name, taints in self._taints.items()}
            for name, (fault, since) in self._fabric.items():
                out.setdefault(name, []).append(fabric_taint(driver, fault, since))
            return out

    def _mps_watch_loop(self) -> None:
        """Start again the MPS daemon of a prepared claim that died (its clients cannot connect without it), with
        an Event on the claim; a daemon that cannot be started is a Warning once per distinct reason."""
        told: dict[str, str] = {}
        while not self._stop.wait(self.config.mps_watch_interval_s):
            try:
                revivals = self._preparer.revive_dead_daemons()
            except Exception:  # the lock was busy, the checkpoint unreadable: try again on the next round
                log.exception("checking the MPS daemons of prepared claims failed")
                continue
            for r in revivals:
                claim = ClaimRef(r.namespace, r.uid, r.name)
                if not r.error:
                    told.pop(r.uid, None)
                    message = (
                        f"the MPS control daemon of this claim (pid {r.old_pid}) was gone; started it "
                        f"again (pid {r.new_pid})"
                    )
                    log.warning("claim %s/%s: %s", r.namespace, r.name, message, extra={"claim_uid": r.uid})
                    self._notify(claim, "Warning", "MpsDaemonRestarted", message)
                elif told.get(r.uid) != r.error:
                    told[r.uid] = r.error
                    log.error("claim %s/%s: %s", r.namespace, r.name, r.error, extra={"claim_uid": r.uid})
                    self._notify(claim, "Warning", "MpsDaemonRestartFailed", r.error)

    def _health_publish_loop(self) -> None:
        while True:
            self._health_changed.wait()
            if self._stop.is_set():
                return
            self._health_changed.clear()
            self._record_health(self._inventory)  # MIG placements of a newly unhealthy GPU follow it
            try:
                self._on_published(self._publisher.publish(self._schedulable(self._inventory)))
            except Exception:  # keep this thread alive: the next change or the resync loop tries again
                log.exception("publishing slices after a health change failed")
                self.metrics.publish_errors.inc()


def _by_gpu(held: Iterable[tuple[str, str]], minors: Collection[int]) -> dict[int, set[str]]:
    """(device name, holder) pairs as the holders of each of `minors` (a MIG device counts for its GPU)."""
    out: dict[int, set[str]] = {}
    for device_name, holder in held:
        try:
            parsed = parse_device_name(device_name)
        except InvalidDeviceName:
            continue
        minor = parsed.minor if isinstance(parsed, GpuName) else parsed.parent_minor
        if minor in minors:
            out.setdefault(minor, set()).add(holder)
    return out


def _kept(old: DeviceHealth | None, new: DeviceHealth) -> DeviceHealth:
    """The device's record as it was when neither its health nor why has changed (its time stays), else `new`."""
    return old if old is not None and (old.health, old.message) == (new.health, new.message) else new
