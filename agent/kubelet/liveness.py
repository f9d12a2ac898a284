"""Liveness: is the plugin answering on its own sockets the way the kubelet calls it?"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from agent._proto.kubelet import dra_v1_pb2, dra_v1_pb2_grpc
from agent._proto.kubelet import pluginregistration_v1_pb2 as reg_pb
from agent._proto.kubelet import pluginregistration_v1_pb2_grpc as reg_grpc

# The gRPC health service name a probe asks for (NVIDIA's driver uses the same); "" means the whole server.
LIVENESS_SERVICE = "liveness"


def probe(registration_socket: Path, timeout: float = 5.0) -> str:
    """ "" when GetInfo on the registration socket and an empty NodePrepareResources on the endpoint it
    names both answer; otherwise what failed."""
    try:
        with grpc.insecure_channel(f"unix:{registration_socket}") as channel:
            info = reg_grpc.RegistrationStub(channel).GetInfo(reg_pb.InfoRequest(), timeout=timeout)
        with grpc.insecure_channel(f"unix:{info.endpoint}") as channel:
            dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout
            )
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return ""


class SelfCheckingHealth(health.HealthServicer):
    """grpc.health.v1 whose Check runs a probe each time, for a TCP liveness port outside the pod."""

    def __init__(self, check: Callable[[], str]) -> None:
        super().__init__()
        self._check = check

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.service not in ("", LIVENESS_SERVICE):
            context.set_code(grpc.StatusCode.NOT_FOUND)
            return health_pb2.HealthCheckResponse()
        problem = self._check()
        if problem:
            context.set_details(problem)
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
