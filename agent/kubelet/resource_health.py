"""DRAResourceHealth: streams the full device health list to the kubelet on every change.

Served in two versions with the same stream: v1alpha1 (kubelets 1.31-1.36 with ResourceHealthStatus on) and v1
(1.37+, which also read `message`). Their messages differ only in v1's added fields, so one loop serves both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import grpc

from agent._proto.kubelet import dra_health_v1_pb2 as pb_v1
from agent._proto.kubelet import dra_health_v1_pb2_grpc as pb_v1_grpc
from agent._proto.kubelet import dra_health_v1alpha1_pb2 as pb
from agent._proto.kubelet import dra_health_v1alpha1_pb2_grpc as pb_grpc
from agent.kubelet.health import HealthSnapshot, HealthSource

MAX_MESSAGE = 1024  # the kubelet truncates longer messages


def to_message(snapshot: HealthSnapshot, messages: ModuleType = pb) -> Any:
    """The snapshot as a NodeWatchResourcesResponse of `messages` (a generated dra-health module)."""
    with_message = "message" in messages.DeviceHealth.DESCRIPTOR.fields_by_name
    return messages.NodeWatchResourcesResponse(
        devices=[
            messages.DeviceHealth(
                device=messages.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                health=d.health.value,
                last_updated_time=d.last_updated,
                **({"message": d.message[:MAX_MESSAGE]} if with_message and d.message else {}),
            )
            for d in snapshot.devices
        ]
    )


class _Streams:
    """The stream loop both versions share; `shutdown()` ends every open stream at once."""

    def __init__(self, source: HealthSource, messages: ModuleType) -> None:
        self._source = source
        self._messages = messages
        self._stopping = threading.Event()

    def shutdown(self) -> None:
        """End every open stream now, so a server stop need not wait out its grace period on them."""
        self._stopping.set()
        self._source.wake_all()

    def _watch(self, context: grpc.ServicerContext) -> Iterator[Any]:
        """The current list at once, then the list after each change, until the kubelet or stop() cancels."""
        cancelled = threading.Event()

        def cancel() -> None:
            cancelled.set()
            self._source.wake_all()

        def over() -> bool:
            return cancelled.is_set() or self._stopping.is_set()

        if not context.add_callback(cancel):
            return  # already over
        snapshot = self._source.snapshot()
        while not over():
            yield to_message(snapshot, self._messages)
            newer = self._source.wait_newer(snapshot.version, stop=over)
            if newer is None:
                return
            snapshot = newer


class ResourceHealthServicer(_Streams, pb_grpc.DRAResourceHealthServicer):
    """v1alpha1.DRAResourceHealth."""

    def __init__(self, source: HealthSource) -> None:
        super().__init__(source, pb)

    def NodeWatchResources(
        self, request: pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.NodeWatchResourcesResponse]:
        return self._watch(context)


class ResourceHealthServicerV1(_Streams, pb_v1_grpc.DRAResourceHealthServicer):
    """v1.DRAResourceHealth (Kubernetes 1.37+): the same stream, with each device's reason as `message`."""

    def __init__(self, source: HealthSource) -> None:
        super().__init__(source, pb_v1)

    def NodeWatchResources(
        self, request: pb_v1.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb_v1.NodeWatchResourcesResponse]:
        return self._watch(context)
