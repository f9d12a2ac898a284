"""A kubelet stand-in that speaks the real plugin protocol: registration, prepare/unprepare, health watch.

It does what the kubelet's plugin watcher and DRA manager do, minus pods: finds `*-reg.sock` in
`<root>/plugins_registry`, calls GetInfo, validates type/name/endpoint/versions, answers with
NotifyRegistrationStatus, then sends one NodePrepareResources / NodeUnprepareResources per driver per pod,
retrying transient gRPC failures with backoff (standing in for the pod worker's next sync) and rejecting
responses that skip or invent claims, as the kubelet does.

Service choice is the 1.37 kubelet's (pkg/kubelet/cm/dra/plugin, checked against it in the node tier): the
DRAPlugin service is the first of the plugin's advertised ones the kubelet speaks (the plugin's order, not
the kubelet's), kept for the plugin's life with no fallback when the plugin then answers Unimplemented; the
optional DRAResourceHealth service is the kubelet's most recent one the plugin advertises (v1, then v1alpha1).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import grpc

from agent._proto.kubelet import (
    dra_health_v1_pb2,
    dra_health_v1_pb2_grpc,
    dra_health_v1alpha1_pb2,
    dra_health_v1alpha1_pb2_grpc,
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
)
from agent._proto.kubelet import pluginregistration_v1_pb2 as reg_pb
from agent._proto.kubelet import pluginregistration_v1_pb2_grpc as reg_grpc
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.kubelet.health import DeviceHealth, Health

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
V1 = "v1.DRAPlugin"
V1BETA1 = "v1beta1.DRAPlugin"
RESOURCE_HEALTH_V1 = "v1.DRAResourceHealth"
RESOURCE_HEALTH = "v1alpha1.DRAResourceHealth"
# What this kubelet speaks. DRAPlugin: the plugin's order decides; health: most recent first.
KUBELET_VERSIONS = (V1, V1BETA1)
KUBELET_HEALTH_VERSIONS = (RESOURCE_HEALTH_V1, RESOURCE_HEALTH)
_HEALTH_APIS: dict[str, tuple[ModuleType, Any]] = {
    RESOURCE_HEALTH_V1: (dra_health_v1_pb2, dra_health_v1_pb2_grpc.DRAResourceHealthStub),
    RESOURCE_HEALTH: (dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc.DRAResourceHealthStub),
}
_APIS: dict[str, tuple[ModuleType, Any]] = {
    V1: (dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginStub),
    V1BETA1: (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginStub),
}
# Failures worth another try: the plugin restarting, overloaded, or slow. Prepare/unprepare are idempotent.
TRANSIENT = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
# Reconnect soon after a plugin restart, so the call retries above are not all spent in channel backoff.
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

T = TypeVar("T")


class KubeletError(RuntimeError):
    """What the kubelet would report as FailedPrepareDynamicResources / a failed unprepare."""


@dataclass
class Plugin:
    """A registered DRA plugin as the kubelet keeps it."""

    driver: str
    registration_socket: Path
    endpoint: Path
    versions: tuple[str, ...]
    api: str  # the DRAPlugin version calls use
    channel: grpc.Channel = field(repr=False)

    @property
    def health_api(self) -> str | None:
        """The health service the kubelet watches: its most recent one the plugin advertises, if any."""
        return next((v for v in KUBELET_HEALTH_VERSIONS if v in self.versions), None)

    @property
    def serves_health(self) -> bool:
        return self.health_api is not None


@dataclass(frozen=True)
class Retry:
    attempts: int = 5
    initial_backoff: float = 0.05
    max_backoff: float = 2.0


class HealthWatch:
    """An open NodeWatchResources stream: iterate for full device lists; cancel() ends it."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[tuple[DeviceHealth, ...]]:
        return self

    def __next__(self) -> tuple[DeviceHealth, ...]:
        message = next(self._call)
        return tuple(
            DeviceHealth(d.device.pool_name, d.device.device_name, Health(d.health), d.last_updated_time)
            for d in message.devices
        )

    def cancel(self) -> None:
        self._call.cancel()


class FakeKubelet:
    def __init__(
        self,
        root: Path | str,
        *,
        timeout: float = 45.0,
        retry: Retry = Retry(),
        versions: tuple[str, ...] = KUBELET_VERSIONS,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.root = Path(root)
        self.registry = self.root / "plugins_registry"
        self.timeout = timeout  # per call, as the kubelet's 45 s
        self.retry = retry
        self.versions = versions
        self._sleep = sleep
        self._plugins: dict[str, Plugin] = {}
        self.rejected: dict[Path, str] = {}  # registration socket -> why the kubelet refused it
        self._lock = threading.RLock()
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    # registration

    def scan(self) -> list[str]:
        """One pass of the plugin watcher: register new sockets, drop vanished ones; newly registered drivers."""
        self.registry.mkdir(parents=True, exist_ok=True)
        present = set(self.registry.glob("*-reg.sock"))
        added = []
        with self._lock:
            for driver, plugin in list(self._plugins.items()):
                if plugin.registration_socket not in present:
                    self._deregister(driver)
            for socket in set(self.rejected) - present:
                del self.rejected[socket]  # gone; a new plugin there gets a fresh chance
            known = {p.registration_socket for p in self._plugins.values()} | set(self.rejected)
            for socket in sorted(present - known):
                registered = self._register(socket)
                if registered:
                    added.append(registered)
        return added

    def start(self, interval: float = 0.05) -> None:
        """Watch the registry in the background, as the kubelet's plugin watcher does."""

        def loop() -> None:
            while not self._stop.wait(interval):
                try:
                    self.scan()
                except Exception:
                    log.exception("plugin registry scan failed")

        self._stop.clear()
        self._watcher = threading.Thread(target=loop, name="fake-kubelet-watcher", daemon=True)
        self._watcher.start()

    def wait_for_driver(self, driver: str, timeout: float = 10.0) -> Plugin:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if driver in self._plugins:
                    return self._plugins[driver]
            if time.monotonic() > deadline:
                raise KubeletError(f"driver {driver} did not register within {timeout}s; rejected: {self.rejected}")
            if self._watcher is None:
                self.scan()
            time.sleep(0.02)

    def plugin(self, driver: str) -> Plugin:
        with self._lock:
            plugin = self._plugins.get(driver)
        if plugin is None:
            raise KubeletError(f"DRA driver {driver} is not registered with this node")
        return plugin

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None
        with self._lock:
            for driver in list(self._plugins):
                self._deregister(driver)

    def __enter__(self) -> FakeKubelet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self, socket: Path) -> str | None:
        try:
            with grpc.insecure_channel(f"unix:{socket}") as channel:
                stub = reg_grpc.RegistrationStub(channel)
                info = stub.GetInfo(reg_pb.InfoRequest(), timeout=5.0, wait_for_ready=True)
                problem = self._validate(socket, info)
                stub.NotifyRegistrationStatus(
                    reg_pb.RegistrationStatus(plugin_registered=not problem, error=problem), timeout=5.0
                )
        except grpc.RpcError as exc:
            log.warning("registration of %s failed, will retry: %s", socket, exc.code())
            return None
        if problem:
            log.warning("rejected plugin %s: %s", socket, problem)
            self.rejected[socket] = problem
            return None
        versions = tuple(info.supported_versions)
        endpoint = Path(info.endpoint or socket)
        self._plugins[info.name] = Plugin(
            driver=info.name,
            registration_socket=socket,
            endpoint=endpoint,
            versions=versions,
            api=self._choose(versions) or "",
            channel=grpc.insecure_channel(f"unix:{endpoint}", options=CHANNEL_OPTIONS),
        )
        log.info("registered DRA driver %s at %s (%s)", info.name, endpoint, self._plugins[info.name].api)
        return info.name

    def _validate(self, socket: Path, info: reg_pb.PluginInfo) -> str:
        if info.type != DRA_PLUGIN_TYPE:
            return f"no handler registered for plugin type {info.type!r} at socket {socket}"
        if not info.name:
            return "plugin name is empty"
        if info.endpoint and not Path(info.endpoint).is_absolute():
            return f"endpoint {info.endpoint!r} is not an absolute path"
        for other in self._plugins.values():
            if str(other.endpoint) == (info.endpoint or str(socket)):
                return f"endpoint {info.endpoint} is already registered for driver {other.driver}"
        if self._choose(tuple(info.supported_versions)) is None:
            offered = list(info.supported_versions)
            return f"none of the versions {offered} is supported (this kubelet speaks {list(self.versions)})"
        return ""

    def _choose(self, offered: tuple[str, ...]) -> str | None:
        """The first service the plugin offers that this kubelet speaks (the kubelet's validateSupportedServices)."""
        return next((v for v in offered if v in self.versions), None)

    def _deregister(self, driver: str) -> None:
        plugin = self._plugins.pop(driver)
        plugin.channel.close()
        log.info("deregistered DRA driver %s", driver)

    # claims

    def prepare(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, PrepareResult]:
        """One NodePrepareResources call for this driver's claims of a pod; each claim's result by uid."""
        response = self._call(driver, "NodePrepareResources", claims)
        return {
            uid: PrepareResult(
                devices=tuple(
                    PreparedDevice(tuple(d.request_names), d.pool_name, d.device_name, tuple(d.cdi_device_ids))
                    for d in entry.devices
                ),
                error=entry.error,
            )
            for uid, entry in response.claims.items()
        }

    def unprepare(self, driver: str, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """One NodeUnprepareResources call; each claim's error ("" when done) by uid."""
        response = self._call(driver, "NodeUnprepareResources", claims)
        return {uid: entry.error for uid, entry in response.claims.items()}

    def prepare_pod(self, claims: Mapping[str, Sequence[ClaimRef]]) -> dict[str, dict[str, PrepareResult]]:
        """A pod's claims grouped by driver: one call per driver, as the kubelet's DRA manager does."""
        return {driver: self.prepare(driver, batch) for driver, batch in claims.items() if batch}

    def unprepare_pod(self, claims: Mapping[str, Sequence[ClaimRef]]) -> dict[str, dict[str, str]]:
        return {driver: self.unprepare(driver, batch) for driver, batch in claims.items() if batch}

    def watch_health(self, driver: str, timeout: float | None = None) -> HealthWatch:
        plugin = self.plugin(driver)
        if plugin.health_api is None:
            raise KubeletError(f"driver {driver} offers none of {list(KUBELET_HEALTH_VERSIONS)}")
        messages, stub_type = _HEALTH_APIS[plugin.health_api]
        call = stub_type(plugin.channel).NodeWatchResources(messages.NodeWatchResourcesRequest(), timeout=timeout)
        return HealthWatch(call)

    def _call(self, driver: str, method: str, claims: Sequence[ClaimRef]) -> Any:
        plugin = self.plugin(driver)
        try:
            response = self._with_retries(lambda: self._invoke(plugin, plugin.api, method, claims))
        except grpc.RpcError as exc:  # Unimplemented included: the kubelet keeps the negotiated service
            raise KubeletError(f"{method} for driver {driver}: {exc.code().name}: {exc.details()}") from exc
        _check_entries(method, {c.uid for c in claims}, set(response.claims))
        return response

    def _invoke(self, plugin: Plugin, api: str, method: str, claims: Sequence[ClaimRef]) -> Any:
        messages, stub_type = _APIS[api]
        request_type = getattr(messages, f"{method}Request")
        request = request_type(claims=[messages.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims])
        return getattr(stub_type(plugin.channel), method)(request, timeout=self.timeout)

    def _with_retries(self, call: Callable[[], T]) -> T:
        backoff = self.retry.initial_backoff
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return call()
            except grpc.RpcError as exc:
                if exc.code() not in TRANSIENT or attempt == self.retry.attempts:
                    raise
                log.info("transient %s, retry %d in %.2fs", exc.code().name, attempt, backoff)
                self._sleep(backoff)
                backoff = min(backoff * 2, self.retry.max_backoff)
        raise AssertionError("unreachable")


def _check_entries(method: str, asked: set[str], answered: set[str]) -> None:
    """The kubelet's rule: every claim gets an entry and no entry names a claim it did not send."""
    if asked - answered:
        raise KubeletError(f"{method} skipped {len(asked - answered)} ResourceClaims")
    if answered - asked:
        raise KubeletError(f"{method} returned result for unknown claim UIDs {sorted(answered - asked)}")
