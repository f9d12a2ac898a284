"""The plugin registration service the kubelet's plugin watcher calls on <driver>-reg.sock."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc

from agent._proto.kubelet import pluginregistration_v1_pb2 as pb
from agent._proto.kubelet import pluginregistration_v1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
# gRPC service names, listed in preference order (the kubelet takes the first one it supports).
DRA_V1 = "v1.DRAPlugin"
DRA_V1BETA1 = "v1beta1.DRAPlugin"
# Health stream versions: a 1.37+ kubelet picks v1 when both are listed (pickHealthService in
# kubernetes/kubernetes pkg/kubelet/cm/dra/plugin), older ones know only v1alpha1.
RESOURCE_HEALTH_V1 = "v1.DRAResourceHealth"
RESOURCE_HEALTH_V1ALPHA1 = "v1alpha1.DRAResourceHealth"
SUPPORTED_VERSIONS = (DRA_V1, DRA_V1BETA1, RESOURCE_HEALTH_V1, RESOURCE_HEALTH_V1ALPHA1)


@dataclass(frozen=True)
class RegistrationStatus:
    """What the kubelet last told us: registered, or the reason it was not."""

    registered: bool
    error: str = ""


class RegistrationFailed(RuntimeError):
    """The kubelet rejected the plugin."""


class RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, driver_name: str, endpoint: str, supported_versions: tuple[str, ...]) -> None:
        self._info = pb.PluginInfo(
            type=PLUGIN_TYPE, name=driver_name, endpoint=endpoint, supported_versions=supported_versions
        )
        self._status: RegistrationStatus | None = None
        self._notified = threading.Condition()

    def GetInfo(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.PluginInfo:
        return self._info

    def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: grpc.ServicerContext
    ) -> pb.RegistrationStatusResponse:
        status = RegistrationStatus(request.plugin_registered, request.error)
        if status.registered:
            log.info("registered with the kubelet", extra={"driver": self._info.name})
        else:
            log.error("kubelet rejected the plugin: %s", status.error, extra={"driver": self._info.name})
        with self._notified:
            self._status = status
            self._notified.notify_all()
        return pb.RegistrationStatusResponse()

    @property
    def status(self) -> RegistrationStatus | None:
        """None until the kubelet has called NotifyRegistrationStatus."""
        with self._notified:
            return self._status

    def wait(self, timeout: float | None = None) -> RegistrationStatus | None:
        """The kubelet's status once it has sent one (None on timeout); raises RegistrationFailed on rejection."""
        with self._notified:
            self._notified.wait_for(lambda: self._status is not None, timeout)
            status = self._status
        if status is not None and not status.registered:
            raise RegistrationFailed(f"kubelet rejected driver {self._info.name}: {status.error}")
        return status
