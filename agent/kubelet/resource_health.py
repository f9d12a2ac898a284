"""DRAResourceHealth v1alpha1: streams the full device health list to the kubelet on every change."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc

from agent._proto.kubelet import dra_health_v1alpha1_pb2 as pb
from agent._proto.kubelet import dra_health_v1alpha1_pb2_grpc as pb_grpc
from agent.kubelet.health import HealthSnapshot, HealthSource


def to_message(snapshot: HealthSnapshot) -> pb.NodeWatchResourcesResponse:
    return pb.NodeWatchResourcesResponse(
        devices=[
            pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                health=pb.HealthStatus.ValueType(d.health.value),
                last_updated_time=d.last_updated,
            )
            for d in snapshot.devices
        ]
    )


class ResourceHealthServicer(pb_grpc.DRAResourceHealthServicer):
    """Each open stream holds a server worker for as long as it is open, so at most `max_streams` are
    served at once (the server gets that many workers more than prepare needs); one more is refused with
    RESOURCE_EXHAUSTED, and the kubelet retries it later."""

    def __init__(self, source: HealthSource, max_streams: int = 16) -> None:
        self._source = source
        self._stopping = threading.Event()
        self.max_streams = max_streams
        self._open = 0
        self._count = threading.Lock()

    def shutdown(self) -> None:
        """End every open stream now, so a server stop need not wait out its grace period on them."""
        self._stopping.set()
        self._source.wake_all()

    def NodeWatchResources(
        self, request: pb.NodeWatchResourcesRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.NodeWatchResourcesResponse]:
        """The current list at once, then the list after each change, until the kubelet or stop() cancels."""
        cancelled = threading.Event()

        def cancel() -> None:
            cancelled.set()
            self._source.wake_all()

        def over() -> bool:
            return cancelled.is_set() or self._stopping.is_set()

        with self._count:
            admitted = self._open < self.max_streams
            self._open += admitted
        if not admitted:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.max_streams} health streams are open already; close one or retry later",
            )
        try:
            if not context.add_callback(cancel):
                return  # already over
            snapshot = self._source.snapshot()
            while not over():
                yield to_message(snapshot)
                newer = self._source.wait_newer(snapshot.version, stop=over)
                if newer is None:
                    return
                snapshot = newer
        finally:
            with self._count:
                self._open -= 1
