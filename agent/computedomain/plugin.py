"""The node agent's second DRA driver, compute-domain.nvidia.com: IMEX channels and the domains' IMEX daemons.

Served by the node agent process (`--compute-domains`) beside gpu.nvidia.com, with its own kubelet sockets,
ResourceSlice, checkpoint and CDI specs. Only a node whose GPUs are all in one fabric clique publishes devices.

Prepare of a channel claim, as NVIDIA's plugin does it: the claim's config names its ComputeDomain (by UID, which
must be in the claim's namespace); the domain's IMEX daemon is started on this node if it does not run yet (its
entry added to status.nodes), and prepare waits for it to be ready (`nvidia-imex-ctl -q`); not ready in time is
this claim's error and the kubelet asks again. Then the channel device nodes are made under the dev root (major from
/proc/devices) and the claim's CDI spec injects them: one channel, or every channel for allocationMode All. Each
step is in the checkpoint first, so a kill -9 anywhere leaves nothing that a restart does not take back.
Unprepare removes what prepare made; the last claim of a domain on this node stops its daemon and removes the
node's entry. One domain per node at a time: channel-0 is one device, as in NVIDIA's driver.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent import files
from agent.claims.cdi import CdiStore
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.computedomain import channels, model
from agent.computedomain import status as domain_status
from agent.computedomain.channels import ChannelConfig, ConfigError
from agent.computedomain.checkpoint import COMPLETED, STARTED, Checkpoint, CheckpointStore, ClaimRecord
from agent.computedomain.checkpoint import PreparedDevice as RecordedDevice
from agent.computedomain.daemon import IMEX, IMEX_CTL, DaemonError, DomainDaemon, stop_leftovers
from agent.computedomain.model import DRIVER, ComputeDomain, InvalidComputeDomain
from agent.jsontypes import Json
from agent.kube.claims import KubeClaimSource
from agent.kube.errors import ApiError, NotFound
from agent.kube.informer import Informer
from agent.kube.rest import COMPUTE_DOMAINS, RESOURCE_SLICES, Rest
from agent.kubelet.plugin import KubeletPlugin
from agent.sharing.commands import DriverRoot, NotRun

log = logging.getLogger(__name__)

UID_INDEX = "uid"


@dataclass(frozen=True)
class ComputeDomainSettings:
    node_name: str
    kubelet_root: Path
    cdi_root: Path
    state_dir: Path  # the agent's; this plugin keeps its files in <state_dir>/compute-domains
    driver_root: Path
    ip_address: str  # where this node's IMEX daemons listen (the agent pod's IP): status.nodes[].ipAddress
    dev_root: Path = Path("/")
    proc_devices: Path = Path("/proc/devices")
    channel_count: int = channels.DEFAULT_CHANNEL_COUNT
    ready_wait_s: float = 20.0  # how long one prepare waits for the local daemon (the kubelet's call allows 45 s)
    check_interval_s: float = 1.0  # how often daemons are asked whether they are ready and peers are followed
    daemon_env: Mapping[str, str] | None = None  # added to the agent's environment for nvidia-imex(-ctl)
    liveness_address: str | None = None  # the node agent's gRPC liveness endpoint, when the GPU plugin is off


class ComputeDomainPlugin:
    """The kubelet's Preparer for compute-domain.nvidia.com, and the IMEX daemons of this node."""

    def __init__(self, settings: ComputeDomainSettings, rest: Rest, clique_id: str | None, boot_id: str) -> None:
        self.settings = settings
        self.clique_id = clique_id or None  # None: GPUs in no fabric clique, nothing is published
        self._rest = rest
        self._claims = KubeClaimSource(rest)
        self._root = settings.state_dir / "compute-domains"
        self._store = CheckpointStore(self._root, boot_id)
        self._specs = CdiStore(settings.cdi_root, kind=channels.CDI_KIND)
        self._daemons_root = self._root / "domains"
        self._lock = threading.RLock()  # prepare, unprepare, recovery and the supervisor, one at a time
        self._checkpoint = Checkpoint(boot_id)
        self.daemons: dict[str, DomainDaemon] = {}
        self._ready: dict[str, bool] = {}  # domain uid -> last readiness written to status.nodes
        self._names: dict[str, tuple[str, str]] = {}  # domain uid -> (namespace, name) of the daemons running
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self.domains = Informer(
            rest,
            COMPUTE_DOMAINS,
            self._wake.set,
            optional=True,
            indexers={UID_INDEX: lambda o: [str((o.get("metadata") or {}).get("uid"))]},
        )
        self.kubelet: KubeletPlugin | None = None
        self._major: int | None = None
        self._node_uid: str | None = None
        self.published = False

    # --- life ------------------------------------------------------------------------------------------

    def start(self, node_uid: str | None) -> None:
        self.domains.start()
        self.domains.wait_synced(30)
        self.recover()
        self._node_uid = node_uid
        try:
            self.publish(node_uid)
        except ApiError as exc:  # the supervisor publishes again; the kubelet is served meanwhile
            log.warning("publishing the compute-domain slice failed, retrying: %s", exc)
        self.kubelet = KubeletPlugin(
            DRIVER, self.settings.kubelet_root, self, liveness_address=self.settings.liveness_address
        )
        self.kubelet.start()
        self._thread = threading.Thread(target=self._supervise, name="imex-daemons", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and stop this node's daemons (a restarted agent starts those its claims need again)."""
        self._stop.set()
        self._wake.set()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for uid, daemon in list(self.daemons.items()):
                daemon.halt()  # its files stay: the next start finds the domain's directory
                self._set_status(uid, model.NOT_READY, force=True)
            self.daemons.clear()
        self.domains.stop()

    # --- publishing --------------------------------------------------------------------------------------

    def set_clique(self, clique_id: str | None) -> None:
        """The node's clique as discovery now reports it: a node whose fabric broke (or was repartitioned)
        withdraws or republishes its channels; prepared claims and running daemons stay until unprepared."""
        if clique_id == self.clique_id:
            return
        log.warning(
            "compute domains: this node's fabric clique changed", extra={"old": self.clique_id, "new": clique_id}
        )
        self.clique_id = clique_id
        self.published = False
        self._wake.set()

    def publish(self, node_uid: str | None) -> None:
        """This node's slice: channel-0 and daemon-0 in a fabric clique; none outside one (a stale one goes)."""
        name = f"{self.settings.node_name}-{DRIVER}"
        try:
            current: Json | None = self._rest.get(RESOURCE_SLICES, None, name)
        except NotFound:
            current = None
        if self.clique_id is None:
            if current is not None:
                with contextlib.suppress(NotFound):
                    self._rest.delete(RESOURCE_SLICES, None, name)
            log.info("compute domains: this node's GPUs are in no fabric clique; no IMEX channels published")
            self.published = True
            return
        generation = int(((current or {}).get("spec") or {}).get("pool", {}).get("generation", 0))
        want = channels.resource_slice(self.settings.node_name, node_uid, generation, self.clique_id)
        if current is None:
            self._rest.create(RESOURCE_SLICES, None, want)
        elif current["spec"] != want["spec"] or current["metadata"].get("ownerReferences") != want["metadata"].get(
            "ownerReferences"
        ):
            want = channels.resource_slice(self.settings.node_name, node_uid, generation + 1, self.clique_id)
            want["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            self._rest.replace(RESOURCE_SLICES, want)
        self.published = True
        log.info("compute domains: IMEX channels published", extra={"clique": self.clique_id})

    # --- the kubelet's calls -----------------------------------------------------------------------------

    def prepare(self, claims: Sequence[ClaimRef], timeout: float | None = None) -> dict[str, PrepareResult]:
        deadline = time.monotonic() + min(timeout if timeout is not None else 45.0, 45.0) - 2.0
        out = {}
        for ref in claims:
            try:
                out[ref.uid] = self._prepare(ref, deadline)
            except (ConfigError, InvalidComputeDomain, DaemonError, ApiError, OSError) as exc:
                log.warning(
                    "prepare of channel claim %s/%s failed: %s",
                    ref.namespace,
                    ref.name,
                    exc,
                    extra={"claim_uid": ref.uid},
                )
                out[ref.uid] = PrepareResult(error=str(exc))
        return out

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        out = {}
        for ref in claims:
            try:
                self._unprepare(ref)
                out[ref.uid] = ""
            except (ApiError, OSError) as exc:
                out[ref.uid] = str(exc)
        return out

    def _prepare(self, ref: ClaimRef, deadline: float) -> PrepareResult:
        with self._lock:  # `ref` was screened at the kubelet edge (agent.kubelet.dra)
            record = self._checkpoint.claims.get(ref.uid)
            if record is not None and record.state == COMPLETED:
                return _result(self.settings.node_name, record)
        claim = self._claims.get(ref.namespace, ref.name, timeout=max(deadline - time.monotonic(), 1.0))
        if str((claim.get("metadata") or {}).get("uid")) != ref.uid:
            return PrepareResult(
                error=f"claim {ref.namespace}/{ref.name} is not the one the kubelet asked for "
                f"(UID {ref.uid}): it was deleted and created again"
            )
        wanted = self._allocated(claim)
        domain = self._domain_of(ref, wanted)
        with self._lock:
            if problem := self._busy(ref, domain):
                return PrepareResult(error=problem)
            made = self._intent(ref, domain, wanted)
            daemon = self._ensure_daemon(domain)
        ready, said = self._wait_ready(daemon, deadline)
        if not ready:
            return PrepareResult(
                error=f"the IMEX daemon of ComputeDomain {domain.namespace}/{domain.name} is not "
                f"ready on node {self.settings.node_name} yet ({said}); the kubelet will ask "
                "again"
            )
        with self._lock:
            self._set_status(domain.uid, model.READY)
            return self._complete(ref, domain, wanted, made)

    def _allocated(self, claim: Mapping[str, Any]) -> list[tuple[str, str, channels.DeviceConfig]]:
        """(request, device, config) of each of this node's compute-domain devices in the claim's allocation."""
        allocation = (claim.get("status") or {}).get("allocation")
        if not allocation:
            raise ConfigError("the claim is not allocated")
        configs = channels.configs_by_request(allocation)
        out = []
        for result in (allocation.get("devices") or {}).get("results") or ():
            if result.get("driver") != DRIVER:
                continue
            if result.get("pool") != self.settings.node_name:
                raise ConfigError(
                    f"device {result.get('device')} is from pool {result.get('pool')}, not this "
                    f"node's ({self.settings.node_name})"
                )
            device = str(result.get("device"))
            if channels.device_type(device) is None:
                raise ConfigError(f"{device} is not a device of {DRIVER} (channel-0, daemon-0)")
            request = str(result.get("request"))
            out.append((request, device, channels.config_for(request, device, configs)))
        if not out:
            raise ConfigError(f"the claim allocates no {DRIVER} device of this node")
        return out

    def _domain_of(self, ref: ClaimRef, wanted: Sequence[tuple[str, str, channels.DeviceConfig]]) -> ComputeDomain:
        uids = {config.domain_id for _, _, config in wanted}
        if len(uids) != 1:
            raise ConfigError(
                f"the claim names {len(uids)} ComputeDomains ({', '.join(sorted(uids))}); one claim serves one domain"
            )
        uid = uids.pop()
        found = self.domains.by_index(UID_INDEX, uid)
        if not found:
            try:  # the informer may not have seen a domain created a moment ago
                found = [
                    o
                    for o in self._rest.list(COMPUTE_DOMAINS, ref.namespace)["items"]
                    if (o.get("metadata") or {}).get("uid") == uid
                ]
            except NotFound:
                found = []
        if not found:
            raise ConfigError(f"ComputeDomain with UID {uid} not found in namespace {ref.namespace}")
        domain = model.parse(found[0])
        if domain.namespace != ref.namespace:
            raise ConfigError(
                f"the claim is in namespace {ref.namespace}, its ComputeDomain {domain.name} in "
                f"{domain.namespace}: a claim may use only a domain of its own namespace"
            )
        if domain.deleting:
            raise ConfigError(f"ComputeDomain {domain.namespace}/{domain.name} is being deleted")
        if self.clique_id is None:
            raise ConfigError(f"node {self.settings.node_name}'s GPUs are in no NVLink fabric clique")
        return domain

    def _busy(self, ref: ClaimRef, domain: ComputeDomain) -> str:
        for other in self._checkpoint.claims.values():
            if other.uid == ref.uid:
                continue
            if other.domain_uid != domain.uid:
                return (
                    f"node {self.settings.node_name}'s IMEX daemon serves ComputeDomain {other.domain} (claim "
                    f"{other.namespace}/{other.name}); one domain per node at a time"
                )
            if other.state == COMPLETED and any(d.device == channels.CHANNEL_DEVICE for d in other.devices):
                return (
                    f"channel 0 already allocated by claim {other.namespace}/{other.name} ({other.uid}) of "
                    f"ComputeDomain {other.domain}"
                )
        return ""

    def _intent(
        self, ref: ClaimRef, domain: ComputeDomain, wanted: Sequence[tuple[str, str, channels.DeviceConfig]]
    ) -> tuple[int, ...]:
        """Record PrepareStarted with the channel nodes about to be made (those missing now); returns them."""
        want = sorted(
            {
                c
                for _, _, config in wanted
                if isinstance(config, ChannelConfig)
                for c in channels.channels_for(config, self.settings.channel_count)
            }
        )
        earlier = self._checkpoint.claims.get(ref.uid)
        made = set(earlier.made_nodes if earlier is not None else ())
        made |= {c for c in want if not self._node_path(c).exists()}
        record = ClaimRecord(
            ref.uid,
            ref.namespace,
            ref.name,
            STARTED,
            domain.uid,
            f"{domain.namespace}/{domain.name}",
            made_nodes=tuple(sorted(made)),
        )
        self._save(ref.uid, record)
        return record.made_nodes

    def _complete(
        self,
        ref: ClaimRef,
        domain: ComputeDomain,
        wanted: Sequence[tuple[str, str, channels.DeviceConfig]],
        made: Sequence[int],
    ) -> PrepareResult:
        major = self._channels_major()
        devices: dict[str, tuple[int, ...]] = {}
        recorded = []
        for request, device, config in wanted:
            chans = (
                channels.channels_for(config, self.settings.channel_count) if isinstance(config, ChannelConfig) else ()
            )
            devices[device] = chans
            recorded.append(RecordedDevice(request, device, chans, (channels.cdi_device_id(ref.uid, device),)))
        for channel in made:
            self._mknod(channel, major)
        env = {
            "COMPUTE_DOMAIN_UUID": domain.uid,
            "COMPUTE_DOMAIN_NAME": domain.name,
            "COMPUTE_DOMAIN_NAMESPACE": domain.namespace,
            "CLIQUE_ID": self.clique_id or "",
        }
        spec = channels.claim_spec(ref.uid, devices, major, str(self.settings.dev_root), env)
        self._specs.write(ref.uid, spec)
        record = self._checkpoint.claims[ref.uid].completed(tuple(recorded))
        self._save(ref.uid, record)
        log.info(
            "channel claim prepared",
            extra={
                "claim": f"{ref.namespace}/{ref.name}",
                "claim_uid": ref.uid,
                "domain": record.domain,
                "channels": len(devices.get(channels.CHANNEL_DEVICE, ())),
            },
        )
        return _result(self.settings.node_name, record)

    def _unprepare(self, ref: ClaimRef) -> None:
        with self._lock:
            record = self._checkpoint.claims.get(ref.uid)
            if record is None:
                return
            self._take_back(record)
            self._save(ref.uid, None)
            if record.domain_uid not in self._checkpoint.domains():
                self._stop_daemon(record.domain_uid)

    def _take_back(self, record: ClaimRecord) -> None:
        self._specs.remove(record.uid)
        for channel in record.made_nodes:
            files.remove(self._node_path(channel))

    # --- recovery ----------------------------------------------------------------------------------------

    def recover(self) -> dict[str, int]:
        """After any stop: roll back started claims, remove specs and temp files no completed claim owns, stop
        daemons an earlier agent left, and start those of the domains completed claims use."""
        with self._lock:
            checkpoint, other_boot = self._store.load()
            self._checkpoint = checkpoint
            if other_boot:
                log.info("compute domains: the checkpoint is from another boot; its claims are void")
                self._store.save(checkpoint)
            rolled_back = 0
            maybe_joined: dict[str, tuple[str, str]] = {}  # domain uid -> (namespace, name) this node may be in
            for record in [r for r in checkpoint.claims.values() if r.state == STARTED]:
                self._take_back(record)
                self._save(record.uid, None)
                namespace, _, name = record.domain.partition("/")
                maybe_joined[record.domain_uid] = (namespace, name)
                rolled_back += 1
            stray = self._specs.claim_uids() - set(checkpoint.claims)
            for uid in stray:
                self._specs.remove(uid)
            specs = len(stray)
            for temp in self._specs.leftover_temps():
                files.remove(temp)
            needed = self._checkpoint.domains()
            leftovers = stop_leftovers(self._daemons_root, keep=needed)
            for uid in set(leftovers) - needed:
                if found := self.domains.by_index(UID_INDEX, uid):
                    meta = found[0]["metadata"]
                    maybe_joined[uid] = (meta["namespace"], meta["name"])
            for uid, names in maybe_joined.items():  # an entry in status.nodes no daemon stands behind any more
                if uid not in needed:
                    with contextlib.suppress(ApiError):
                        domain_status.remove_entry(self._rest, *names, self.settings.node_name)
            for uid in sorted(needed):
                obj = self.domains.by_index(UID_INDEX, uid)
                if obj:
                    with contextlib.suppress(DaemonError, ApiError, OSError):
                        self._ensure_daemon(model.parse(obj[0]))
            summary = {
                "rolled_back": rolled_back,
                "removed_specs": specs,
                "stopped_daemons": len(leftovers),
                "prepared": len(self._checkpoint.claims),
            }
            log.info("compute-domain checkpoint ready", extra=summary)
            return summary

    # --- daemons -----------------------------------------------------------------------------------------

    def _ensure_daemon(self, domain: ComputeDomain) -> DomainDaemon:
        daemon = self.daemons.get(domain.uid)
        if daemon is not None:
            return daemon
        clique = self.clique_id or ""
        written = domain_status.set_entry(
            self._rest,
            domain.namespace,
            domain.name,
            node_name=self.settings.node_name,
            ip_address=self.settings.ip_address,
            clique_id=clique,
            status=model.NOT_READY,
        )
        peers = model.clique_peers((written or domain).nodes, clique)
        root = DriverRoot(self.settings.driver_root)
        try:
            imex, ctl = Path(root.find(IMEX)), Path(root.find(IMEX_CTL))
        except NotRun as exc:
            raise DaemonError(str(exc)) from None
        env = {**os.environ, **(self.settings.daemon_env or {})}
        if library_path := root.library_path():
            env["LD_LIBRARY_PATH"] = library_path
        daemon = DomainDaemon(
            domain.uid, self._daemons_root / domain.uid, imex, ctl, bind_address=self.settings.ip_address, env=env
        )
        daemon.start(peers)
        self.daemons[domain.uid] = daemon
        self._ready[domain.uid] = False
        self._names[domain.uid] = (domain.namespace, domain.name)
        return daemon

    def _stop_daemon(self, uid: str) -> None:
        daemon = self.daemons.pop(uid, None)
        if daemon is not None:
            daemon.stop()
        self._ready.pop(uid, None)
        names = self._names.pop(uid, None)
        if names is not None:
            with contextlib.suppress(ApiError):
                domain_status.remove_entry(self._rest, *names, self.settings.node_name)

    def _wait_ready(self, daemon: DomainDaemon, deadline: float) -> tuple[bool, str]:
        wait_until = min(deadline, time.monotonic() + self.settings.ready_wait_s)
        while True:
            ready, said = daemon.check()
            if ready or time.monotonic() >= wait_until:
                return ready, said
            time.sleep(0.1)

    def _set_status(self, uid: str, status: str, *, force: bool = False) -> None:
        """This node's entry with `status`, written when it changed (or `force`: it may be missing)."""
        if not force and self._ready.get(uid) == (status == model.READY):
            return
        names = self._names.get(uid)
        if names is None:
            return
        try:
            domain_status.set_entry(
                self._rest,
                *names,
                node_name=self.settings.node_name,
                ip_address=self.settings.ip_address,
                clique_id=self.clique_id or "",
                status=status,
            )
            self._ready[uid] = status == model.READY
        except (ApiError, ValueError) as exc:
            log.warning("writing this node's status to ComputeDomain %s/%s failed: %s", *names, exc)

    def _supervise(self) -> None:
        """Follow each running daemon: its readiness to status.nodes, its peers to its nodes file, a dead one
        started again, a domain deleted under it stopped."""
        while not self._stop.is_set():
            self._wake.wait(self.settings.check_interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            if not self.published:
                with contextlib.suppress(ApiError):
                    self.publish(self._node_uid)
            with self._lock:
                for uid, daemon in list(self.daemons.items()):
                    try:
                        self._follow(uid, daemon)
                    except Exception:  # one domain's trouble never stops the others'
                        log.exception("following the IMEX daemon of ComputeDomain %s failed", uid)

    def _follow(self, uid: str, daemon: DomainDaemon) -> None:
        obj = self.domains.by_index(UID_INDEX, uid)
        if not obj:
            return  # deleted: its claims' unprepare stops the daemon
        domain = model.parse(obj[0])
        if daemon.revive():
            log.warning(
                "the IMEX daemon of ComputeDomain %s/%s had exited; started it again", domain.namespace, domain.name
            )
        mine = next((n for n in domain.nodes if n.name == self.settings.node_name), None)
        if mine is not None:
            daemon.update(model.clique_peers(domain.nodes, self.clique_id or ""))
        ready, _ = daemon.check()
        # an entry dropped under us (a person, a stale-entry clean-up) is written again
        self._set_status(uid, model.READY if ready else model.NOT_READY, force=mine is None)

    # --- files -------------------------------------------------------------------------------------------

    def _save(self, uid: str, record: ClaimRecord | None) -> None:
        claims = dict(self._checkpoint.claims)
        if record is None:
            claims.pop(uid, None)
        else:
            claims[uid] = record
        checkpoint = Checkpoint(self._checkpoint.boot_id, claims)
        self._store.save(checkpoint)
        self._checkpoint = checkpoint

    def _node_path(self, channel: int) -> Path:
        return self.settings.dev_root / channels.channel_path(channel).lstrip("/")

    def _channels_major(self) -> int:
        if self._major is None:
            try:
                text = self.settings.proc_devices.read_text()
            except OSError as exc:
                raise ConfigError(f"cannot read {self.settings.proc_devices}: {exc.strerror}") from None
            major = channels.imex_channels_major(text)
            if major is None:
                raise ConfigError(
                    f"{self.settings.proc_devices} lists no {channels.PROC_DEVICES_NAME}: the NVIDIA "
                    "driver on this node does not offer IMEX channels"
                )
            self._major = major
        return self._major

    def _mknod(self, channel: int, major: int) -> None:
        path = self._node_path(channel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, channel))
        os.chmod(path, 0o666)  # noqa: S103 - every process of the pod opens its channel, as with NVIDIA's (0666)


def _result(node_name: str, record: ClaimRecord) -> PrepareResult:
    return PrepareResult(
        devices=tuple(PreparedDevice((d.request,), node_name, d.device, d.cdi_ids) for d in record.devices)
    )
