"""A leader writes only while its last renewal of the Lease is within the renew deadline, measured on the
monotonic clock (client-go's rule), whatever write it is: every write of the arbiter passes one gate, its API
client's, and the nodes' reservation calls consult the same gate (issue 33, item 4).

Tried: a fake monotonic clock that jumps past the renew deadline, as it does for a process paused by SIGSTOP;
before the gate, a resumed leader sent its pending claim and pod writes after a standby had taken the Lease."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from agent.arbiter.controller import NodeDirectory, PinnedClient
from agent.kube.client import Client, Server
from agent.kube.errors import ApiError, NotFound, NotLeading
from agent.kube.leader import LeaderElector, check_timings
from agent.kube.rest import LEASES, PODS, Rest
from agent.reservation.protocol import NodeUnavailable

UNREACHABLE = "http://127.0.0.1:1"  # a request the gate lets through fails to connect (status 0), not NotLeading


class LeaseStore:
    """The Lease alone, as an API server keeps it (get, create, replace)."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None

    def get(self, _resource: Any, _ns: str, _name: str) -> dict[str, Any]:
        if self.lease is None:
            raise NotFound(404, "no lease")
        return {**self.lease, "spec": dict(self.lease["spec"])}

    def create(self, _resource: Any, _ns: str, body: dict[str, Any]) -> dict[str, Any]:
        self.lease = body
        return body

    def replace(self, _resource: Any, body: dict[str, Any]) -> dict[str, Any]:
        self.lease = body
        return body


class Once(threading.Event):
    """A stop event that ends LeaderElector.run after one attempt."""

    def wait(self, timeout: float | None = None) -> bool:
        self.set()
        return True


def elector(store: LeaseStore, clock: list[float]) -> LeaderElector:
    return LeaderElector(
        store,
        "ns",
        "arbiter",
        "me",
        clock=lambda: 1000.0 + clock[0],  # type: ignore[arg-type]
        monotonic=lambda: clock[0],
    )


def renew(e: LeaderElector) -> None:
    e.run(Once())


def a_write(rest: Rest) -> ApiError:
    with pytest.raises(ApiError) as refused:
        rest.patch(PODS, "ns", "pod", {"metadata": {"labels": {"x": "1"}}})
    return refused.value


def test_writes_pass_only_within_the_renew_deadline_of_the_last_renewal() -> None:
    clock = [100.0]
    e = elector(LeaseStore(), clock)
    rest = Rest(Client(Server(UNREACHABLE))).gated(e.check_leading)
    assert isinstance(a_write(rest), NotLeading)  # not leading yet
    renew(e)
    assert e.leading.is_set()
    clock[0] += 9.9
    assert not isinstance(a_write(rest), NotLeading)  # sent (and failed to connect): within the deadline
    clock[0] += 0.1  # the renew deadline (10 s) passed without a renewal: a paused process resuming
    refused = a_write(rest)
    assert isinstance(refused, NotLeading) and "does not hold the Lease ns/arbiter" in str(refused)
    assert e.lost.is_set() and not e.leading.is_set()  # lost for good: the process exits and starts over
    renew(e)  # the Lease may even be free again: this elector stays out
    assert isinstance(a_write(rest), NotLeading)
    with pytest.raises(ApiError) as read:  # reads are not gated
        rest.get(LEASES, "ns", "arbiter")
    assert not isinstance(read.value, NotLeading)


def test_a_renewal_the_process_was_paused_in_does_not_count() -> None:
    clock = [100.0]
    store = LeaseStore()
    e = elector(store, clock)
    renew(e)
    real = store.replace

    def paused_replace(resource: Any, body: dict[str, Any]) -> dict[str, Any]:
        clock[0] += 12  # SIGSTOP between reading the Lease and renewing it
        return real(resource, body)

    store.replace = paused_replace  # type: ignore[method-assign]
    clock[0] += 2
    renew(e)
    with pytest.raises(NotLeading):
        e.check_leading()


def test_the_nodes_reservation_calls_pass_the_same_gate() -> None:
    clock = [100.0]
    e = elector(LeaseStore(), clock)
    directory = NodeDirectory("token", write_gate=e.check_leading)
    node = PinnedClient(directory, "gpu-0", "127.0.0.1:1", "ab" * 32)
    with pytest.raises(NodeUnavailable, match="does not hold the Lease"):
        node.release(gang_id="g")
    with pytest.raises(NodeUnavailable, match="does not hold the Lease"):
        node.confirm("r-1")
    assert not directory._channels  # refused before connecting: nothing was sent


@pytest.mark.parametrize(("lease", "renew_deadline", "retry"), [(15, 15, 2), (15, 10, 10), (10, 15, 2), (15, 10, 0)])
def test_timings_that_would_let_two_leaders_write_are_refused(
    lease: float, renew_deadline: float, retry: float
) -> None:
    with pytest.raises(ValueError, match="retry period .* < renew deadline .* < lease duration"):
        check_timings(lease, renew_deadline, retry)


def test_a_write_that_waited_after_its_first_check_is_checked_again_before_its_bytes_leave() -> None:
    """Between the client's check and the send a write may wait (the rate limiter, the GIL, a pause): the
    gate is consulted again on the send, and a refusal there sends nothing (the connection is closed)."""
    received = bytearray()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def serve() -> None:
            try:
                connection, _ = listener.accept()
            except OSError:  # the client never connected and the listener closed: nothing was sent
                return
            with connection:
                while chunk := connection.recv(65536):
                    received.extend(chunk)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        checks = []

        def lost_while_waiting() -> None:  # the first check passes; by the send the Lease is gone
            checks.append(1)
            if len(checks) > 1:
                raise NotLeading(0, "not writing: lost the Lease meanwhile")

        rest = Rest(Client(Server(f"http://127.0.0.1:{port}")), retries=False).gated(lost_while_waiting)
        with pytest.raises(NotLeading):
            rest.patch(PODS, "ns", "pod", {"metadata": {"labels": {"x": "1"}}})
        server.join(timeout=5)
    assert len(checks) == 2 and bytes(received) == b""
