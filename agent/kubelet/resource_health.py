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


class StreamLimit:
    """Open streams of every version together: each holds a server worker for as long as it is open."""

    def __init__(self, max_streams: int = 16) -> None:
        self.max_streams = max_streams
        self._open = 0
        self._lock = threading.Lock()

    def admit(self) -> bool:
        with self._lock:
            admitted = self._open < self.max_streams
            self._open += admitted
            return admitted

    def release(self) -> None:
        with self._lock:
            self._open -= 1


class _Streams:
    """The stream loop both versions share. At most `limit.max_streams` are served at once (the server gets
    that many workers more than prepare needs); one more is refused with RESOURCE_EXHAUSTED, and the kubelet
    retries it later. `shutdown()` ends every open stream at once."""

    def __init__(self, source: HealthSource, messages: ModuleType, limit: StreamLimit | None = None) -> None:
        self._source = source
        self._messages = messages
        self._limit = limit or StreamLimit()
        self._stopping = threading.Event()

    @property
    def max_streams(self) -> int:
        return self._limit.max_streams

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

        if not self._limit.admit():
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._limit.max_streams} health streams are open already; close one or retry later",
            )
        try:
            if not context.add_callback(cancel):
                return  # already over
            snapshot = self._source.snapshot()
            while not over():
                yield to_message(snapshot, self._messages)
                newer = self._source.wait_newer(snapshot.version, stop=over)
                if newer is None:
                    return
                snapshot = newer
        finally:
            self._limit.release()


class ResourceHealthServicer(_Streams, pb_grpc.DRAResourceHealthServicer):
    """v1alpha1.DRAResourceHealth."""

    def __init__(self, source: HealthSource, max_streams: int = 16, limit: StreamLimit | None = None) -> None:
        super().__init__(source, pb, limit or StreamLimit(max_streams))

    def NodeWatchResources(
        self, request: pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.NodeWatchResourcesResponse]:
        return self._watch(context)


class ResourceHealthServicerV1(_Streams, pb_v1_grpc.DRAResourceHealthServicer):
    """v1.DRAResourceHealth (Kubernetes 1.37+): the same stream, with each device's reason as `message`."""

    def __init__(self, source: HealthSource, max_streams: int = 16, limit: StreamLimit | None = None) -> None:
        super().__init__(source, pb_v1, limit or StreamLimit(max_streams))

    def NodeWatchResources(
        self, request: pb_v1.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb_v1.NodeWatchResourcesResponse]:
        return self._watch(context)
