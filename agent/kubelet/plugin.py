"""The kubelet plugin: registration socket, DRA service socket and liveness, started and stopped as one."""

from __future__ import annotations

import logging
import re
from concurrent import futures
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agent._proto.kubelet import dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2_grpc, pluginregistration_v1_pb2_grpc
from agent.claims.types import Preparer
from agent.kubelet import dra, sockets
from agent.kubelet.health import HealthSource
from agent.kubelet.liveness import LIVENESS_SERVICE, SelfCheckingHealth, probe
from agent.kubelet.registration import (
    DRA_V1,
    DRA_V1BETA1,
    RESOURCE_HEALTH_V1,
    RESOURCE_HEALTH_V1ALPHA1,
    RegistrationServicer,
    RegistrationStatus,
)
from agent.kubelet.resource_health import ResourceHealthServicer, ResourceHealthServicerV1, StreamLimit

log = logging.getLogger(__name__)

DEFAULT_KUBELET_ROOT = Path("/var/lib/kubelet")
# A driver name is a DNS subdomain of at most 63 characters (validated like a CSI driver name).
_DRIVER_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def registration_socket_path(kubelet_root: Path, driver_name: str) -> Path:
    return kubelet_root / "plugins_registry" / f"{driver_name}-reg.sock"


def dra_socket_path(kubelet_root: Path, driver_name: str) -> Path:
    return kubelet_root / "plugins" / driver_name / "dra.sock"


class KubeletPlugin:
    """Serves the kubelet on `<root>/plugins_registry/<driver>-reg.sock` and `<root>/plugins/<driver>/dra.sock`.

    The DRA socket serves DRAPlugin v1 and v1beta1, DRAResourceHealth v1 and v1alpha1 when a health source is given,
    and grpc.health.v1. With `liveness_address` (e.g. "0.0.0.0:51516") a TCP grpc.health.v1 endpoint also
    answers probes by calling the plugin through its own sockets. stop() removes both sockets.
    """

    def __init__(
        self,
        driver_name: str,
        kubelet_root: Path | str,
        preparer: Preparer,
        health_source: HealthSource | None = None,
        *,
        liveness_address: str | None = None,
        dra_versions: tuple[str, ...] = (DRA_V1, DRA_V1BETA1),
        max_workers: int = 16,
        max_health_streams: int = 16,
    ) -> None:
        """`max_workers` serve prepare, unprepare and probes; each of up to `max_health_streams` open health
        streams holds a worker of its own on top of those (a streaming call keeps its thread while open)."""
        if len(driver_name) > 63 or not _DRIVER_NAME.fullmatch(driver_name):
            raise ValueError(f"driver name {driver_name!r} is not a DNS subdomain of at most 63 characters")
        if not dra_versions or not set(dra_versions) <= {DRA_V1, DRA_V1BETA1}:
            raise ValueError(f"dra_versions {dra_versions} must list some of {DRA_V1}, {DRA_V1BETA1}")
        root = Path(kubelet_root).absolute()
        self.driver_name = driver_name
        self.registration_socket = registration_socket_path(root, driver_name)
        self.dra_socket = dra_socket_path(root, driver_name)
        for path in (self.registration_socket, self.dra_socket):
            sockets.check_socket_path(path)
        # Advertised in preference order; both versions are always served (a kubelet may pick either).
        health_versions = (RESOURCE_HEALTH_V1, RESOURCE_HEALTH_V1ALPHA1) if health_source is not None else ()
        self.supported_versions = dra_versions + health_versions
        self._preparer = preparer
        self._health_source = health_source
        self._liveness_address = liveness_address
        self._max_workers = max_workers
        self._max_health_streams = max_health_streams if health_source is not None else 0
        self._registration = RegistrationServicer(driver_name, str(self.dra_socket), self.supported_versions)
        self._serving_health: health.HealthServicer | None = None
        self._health_streams: list[ResourceHealthServicer | ResourceHealthServicerV1] = []
        self._servers: list[grpc.Server] = []
        self._bound: dict[Path, tuple[int, int]] = {}  # socket path -> (device, inode) we bound there
        self.liveness_port: int | None = None

    def start(self) -> None:
        """Serve the DRA socket first, so the endpoint works by the time the kubelet sees the registration."""
        if self._servers:
            raise RuntimeError("kubelet plugin already started")
        try:
            self._servers.append(self._serve_dra())
            self._servers.append(self._serve_registration())
            if self._liveness_address is not None:
                self._servers.append(self._serve_liveness(self._liveness_address))
        except BaseException:
            self.stop(grace=0)
            raise
        log.info(
            "kubelet plugin serving",
            extra={
                "driver": self.driver_name,
                "registration": str(self.registration_socket),
                "endpoint": str(self.dra_socket),
                "versions": list(self.supported_versions),
            },
        )

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving (registration first, so the kubelet stops calling) and remove both sockets."""
        if self._serving_health is not None:
            self._serving_health.enter_graceful_shutdown()  # NOT_SERVING to watchers while we drain
        for streams in self._health_streams:
            streams.shutdown()
        for server in reversed(self._servers):
            server.stop(grace).wait()
        self._servers.clear()
        for path, identity in self._bound.items():
            sockets.remove(path, identity)
        self._bound.clear()

    @property
    def registration_status(self) -> RegistrationStatus | None:
        """What the kubelet last reported through NotifyRegistrationStatus (None before it has)."""
        return self._registration.status

    def wait_registered(self, timeout: float | None = None) -> RegistrationStatus | None:
        """Block until the kubelet reports; raises RegistrationFailed if it rejected the plugin."""
        return self._registration.wait(timeout)

    def __enter__(self) -> KubeletPlugin:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _serve_dra(self) -> grpc.Server:
        server = _grpc_server(self._max_workers + self._max_health_streams, "kubelet-grpc")
        dra.add_to_server(server, dra.ClaimService(self._preparer))
        if self._health_source is not None:
            limit = StreamLimit(self._max_health_streams)  # both versions share the extra workers
            v1 = ResourceHealthServicerV1(self._health_source, limit=limit)
            v1alpha1 = ResourceHealthServicer(self._health_source, limit=limit)
            dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(v1, server)
            dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(v1alpha1, server)
            self._health_streams = [v1, v1alpha1]
        self._serving_health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._serving_health, server)
        for service in ("", LIVENESS_SERVICE):
            self._serving_health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._bound[self.dra_socket] = sockets.bind(server, self.dra_socket)
        server.start()
        return server

    def _serve_registration(self) -> grpc.Server:
        server = _grpc_server(2, "kubelet-reg")
        pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(self._registration, server)
        self._bound[self.registration_socket] = sockets.bind(server, self.registration_socket)
        server.start()
        return server

    def _serve_liveness(self, address: str) -> grpc.Server:
        server = _grpc_server(2, "kubelet-liveness")
        checker = SelfCheckingHealth(lambda: probe(self.registration_socket))
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        self.liveness_port = server.add_insecure_port(address)
        server.start()
        return server


def _grpc_server(workers: int, thread_name_prefix: str) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(workers, thread_name_prefix=thread_name_prefix))
