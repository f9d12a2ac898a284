"""The node agent's reservation API against the API server fake: advertised on the Node with its certificate's
fingerprint, served over TLS, authenticated, counting devices allocated in ResourceClaims, prepared on the
node, and reserved, and re-checking them at Confirm."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from agent.allocation.allocator import Claim, DeviceRequest, NoFit
from agent.arbiter.controller import NodeDirectory
from agent.kube.rest import NODES, RESOURCE_CLAIMS, Rest
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION
from agent.reservation.auth import TokenFileError, read_token
from agent.reservation.node_service import NodeReservations, split_address
from agent.reservation.protocol import NodeUnavailable, ReservationLost, Unauthenticated
from agent.reservation.transport import (
    CertificateMismatch,
    GrpcNodeClient,
    claim_to_pb,
    fingerprint,
    pinned_channel,
    trusting_channel,
)
from tests.unit.test_allocation_allocator import gpu, inventory
from tests.unit.test_reservation_book import TOKEN

apiserver = pytest.importorskip("fakes.apiserver")

NODE = "gpu-node-1"
DRIVER = "gpu.nvidia.com"


@pytest.fixture
def rest() -> Iterator[Rest]:
    with apiserver.start(port=0) as server:
        r = server.rest()
        r.create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield r


@pytest.fixture
def node(rest: Rest) -> Iterator[tuple[NodeReservations, list[tuple[str, str]]]]:
    prepared: list[tuple[str, str]] = []  # (device, its claim)
    inv = inventory(*(gpu(i, "A") for i in range(4)))
    service = NodeReservations(
        node_name=NODE,
        driver=DRIVER,
        inventory=lambda: inv,
        prepared=lambda: prepared,
        unhealthy=lambda: (),
        token=TOKEN,
        rest=rest,
    )
    service.start("127.0.0.1:0")
    yield service, prepared
    service.stop()


def allocated_claim(rest: Rest, name: str, devices: list[str], node: str = NODE) -> None:
    claim = rest.create(
        RESOURCE_CLAIMS,
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": len(devices)}}
                    ]
                }
            },
        },
    )
    claim["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": node, "device": d} for d in devices]},
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
            },
        }
    }
    rest.replace(RESOURCE_CLAIMS, claim, "status")


def gpus(n: int) -> Claim:
    return Claim((DeviceRequest("gpus", count=n),))


def channel(rest: Rest, service: NodeReservations) -> grpc.Channel:
    """As the arbiter connects: to the address the Node names, trusting the certificate it publishes."""
    annotations = rest.get(NODES, None, NODE)["metadata"]["annotations"]
    return pinned_channel(annotations[ADDRESS_ANNOTATION], annotations[FINGERPRINT_ANNOTATION], NODE)


def eventually(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_the_address_is_advertised_on_the_node_and_serves_reservations(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]
) -> None:
    service, _ = node
    address = rest.get(NODES, None, NODE)["metadata"]["annotations"][ADDRESS_ANNOTATION]
    assert address == f"127.0.0.1:{service.port}"
    with channel(rest, service) as ch:
        r = GrpcNodeClient(ch, TOKEN).reserve("g", "ns/pod/m", gpus(4), 30)
        assert len(r.fit.devices["gpus"]) == 4


def test_no_reservation_without_the_token(rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]) -> None:
    service, _ = node
    with channel(rest, service) as ch, pytest.raises(Unauthenticated):  # tried: a wrong token
        GrpcNodeClient(ch, "not-the-token").reserve("g", "ns/pod/m", gpus(1), 30)
    assert service.book.live() == []


def test_allocated_prepared_and_reserved_devices_are_all_taken(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]
) -> None:
    service, prepared = node
    allocated_claim(rest, "held", ["gpu-0"])
    allocated_claim(rest, "elsewhere", ["gpu-1"], node="other-node")  # another node's pool: not ours
    eventually(lambda: "gpu-0" in service.usage().allocated)
    prepared.append(("gpu-3", "default/gone"))  # prepared for a terminating pod whose claim is deallocated
    with channel(rest, service) as ch:
        client = GrpcNodeClient(ch, TOKEN)
        with pytest.raises(NoFit):  # tried: three GPUs where gpu-0 is allocated and gpu-3 prepared
            client.reserve("g", "ns/pod/m", gpus(3), 30)
        r = client.reserve("g", "ns/pod/m", gpus(2), 30)
        assert sorted(r.fit.devices["gpus"]) == ["gpu-1", "gpu-2"]
        with pytest.raises(NoFit):  # tried: one more GPU while gpu-1 and gpu-2 are reserved
            client.reserve("h", "ns/pod/m", gpus(1), 30)
        assert client.release(gang_id="g") == 1
        assert len(client.reserve("h", "ns/pod/m", gpus(2), 30).fit.devices["gpus"]) == 2


def test_a_confirmed_reservation_holds_until_its_claim_is_seen_then_the_claim_counts(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]
) -> None:
    service, _ = node
    now = [1000.0]
    service.book._clock = lambda: now[0]  # type: ignore[method-assign]
    r = service.book.reserve("g", "m", gpus(4), 10)
    service.book.confirm(r.id)
    now[0] += 30  # past the TTL: a confirmed reservation stays
    assert [x.id for x in service.book.live()] == [r.id]
    allocated_claim(rest, "committed", list(r.fit.devices["gpus"]))
    now[0] += 60  # past the confirmed hold: the claim now keeps the devices taken
    assert service.book.live() == []
    eventually(lambda: len(service.usage().allocated) == 4)
    with pytest.raises(NoFit):
        service.book.reserve("h", "m", gpus(1), 10)


def test_an_unreachable_node_is_node_unavailable() -> None:
    with (
        grpc.insecure_channel("127.0.0.1:1") as channel,
        pytest.raises(NodeUnavailable),
    ):  # tried: nothing listens on the port
        GrpcNodeClient(channel, TOKEN, timeout_s=0.5).capacity()


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("", "empty"),
        ("   \n", "empty"),
    ],
    ids=["empty", "whitespace"],
)
def test_an_empty_token_file_is_refused(tmp_path: Any, text: str, error: str) -> None:
    path = tmp_path / "token"
    path.write_text(text)
    with pytest.raises(TokenFileError, match=error):
        read_token(path)
    with pytest.raises(TokenFileError, match="cannot read"):  # tried: a file that does not exist
        read_token(tmp_path / "missing")
    assert read_token(_write(tmp_path / "ok", " tok\n")) == "tok"


def _write(path: Any, text: str) -> Any:
    path.write_text(text)
    return path


@pytest.mark.parametrize("address", ["nohost", "host:", "host:99999", "host:port"])
def test_a_malformed_address_is_refused(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address(address)


# --- issue 17 item 9: TLS, pinned by the fingerprint the Node publishes ---------------------------------


class Recorder(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """What a man in the middle receives: the metadata of every call that reaches it."""

    def __init__(self) -> None:
        self.metadata: list[Any] = []

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.metadata.append(details.invocation_metadata)
        return continuation(details)


@pytest.fixture
def impostor() -> Iterator[tuple[str, Recorder]]:
    """A reservation server with a certificate of its own (same node name), recording what it is sent."""
    from agent.reservation.node_service import self_signed
    from agent.reservation.protocol import NodeAllocatorService
    from agent.reservation.transport import add_to_server
    from tests.unit.test_reservation_book import book

    key, cert = self_signed(NODE, "127.0.0.1")
    recorder = Recorder()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[recorder])
    add_to_server(NodeAllocatorService(book(4), "the-impostors-own-token"), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    yield f"127.0.0.1:{port}", recorder
    server.stop(None)


def test_the_node_publishes_the_fingerprint_of_the_certificate_it_serves(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]
) -> None:
    import ssl

    service, _ = node
    annotations = rest.get(NODES, None, NODE)["metadata"]["annotations"]
    served = ssl.get_server_certificate(("127.0.0.1", service.port))
    assert annotations[FINGERPRINT_ANNOTATION] == fingerprint(served) == fingerprint(service.certificate.decode())
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as plain, pytest.raises(NodeUnavailable):
        GrpcNodeClient(plain, TOKEN, timeout_s=2).capacity()  # tried: plaintext, as before: refused


def test_a_new_agent_start_makes_a_new_certificate(rest: Rest) -> None:
    inv = inventory(gpu(0, "A"))
    seen = []
    for _ in range(2):
        service = NodeReservations(
            node_name=NODE,
            driver=DRIVER,
            inventory=lambda: inv,
            prepared=lambda: (),
            unhealthy=lambda: (),
            token=TOKEN,
            rest=rest,
        )
        service.start("127.0.0.1:0")
        seen.append(rest.get(NODES, None, NODE)["metadata"]["annotations"][FINGERPRINT_ANNOTATION])
        service.stop()
    assert len(set(seen)) == 2


def test_a_man_in_the_middle_with_another_certificate_is_refused_and_never_sees_the_token(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]], impostor: tuple[str, Recorder]
) -> None:
    service, _ = node
    address, recorder = impostor
    published = rest.get(NODES, None, NODE)["metadata"]["annotations"][FINGERPRINT_ANNOTATION]
    # the Node's address is redirected to the impostor: its certificate is not the one published
    with pytest.raises(CertificateMismatch, match="not the .* that gpu-node-1 published"):
        pinned_channel(address, published, NODE)
    # the arbiter's directory: the node's calls fail, nothing reaches the impostor
    directory = NodeDirectory(TOKEN, fingerprint=lambda node: published)
    directory.addresses = {NODE: address}
    with pytest.raises(CertificateMismatch):
        directory.clients()[NODE].reserve("g", "ns/pod/m", gpus(1), 30)
    # even a channel pinned to the real certificate (as if the first look had reached the real server) does
    # not complete its handshake with the impostor, so no call and no token is sent
    with trusting_channel(address, service.certificate.decode(), NODE) as ch, pytest.raises(NodeUnavailable):
        GrpcNodeClient(ch, TOKEN, timeout_s=2).capacity()
    assert recorder.metadata == []
    # the real server, with the published fingerprint, is reached
    directory.addresses = {NODE: f"127.0.0.1:{service.port}"}
    assert directory.clients()[NODE].capacity().free_gpu_milli == 4000
    directory.close()


def test_a_node_that_publishes_no_fingerprint_is_not_connected_to(
    node: tuple[NodeReservations, list[tuple[str, str]]],
) -> None:
    service, _ = node
    directory = NodeDirectory(TOKEN)  # no fingerprint for any node (an agent from before TLS)
    directory.addresses = {NODE: f"127.0.0.1:{service.port}"}
    with pytest.raises(CertificateMismatch, match="publishes no certificate fingerprint"):
        directory.clients()[NODE].capacity()
    for garbage in ("é" * 64, "not hex", "0" * 64):  # tried: a non-ASCII value raised TypeError, not a refusal
        with pytest.raises(CertificateMismatch):
            pinned_channel(f"127.0.0.1:{service.port}", garbage, NODE)


# --- issue 17 items 5 and 7 through the running service ---------------------------------------------------


def test_confirm_fails_when_another_claim_was_allocated_and_prepared_a_reserved_device(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]
) -> None:
    service, prepared = node
    with channel(rest, service) as ch:
        client = GrpcNodeClient(ch, TOKEN)
        r = client.reserve("g", "default/pod-a/claim-a", gpus(4), 30)
        stolen = sorted(r.fit.all_devices)[0]
        allocated_claim(rest, "intruder", [stolen])  # kube-scheduler, not seeing the reservation
        prepared.append((stolen, "default/intruder"))
        eventually(lambda: stolen in service.holders())
        with pytest.raises(ReservationLost, match=f"{stolen} \\(held by ResourceClaim default/intruder"):
            client.confirm(r.id)
        ok = client.reserve("h", "default/pod-b/claim-b", gpus(1), 30)
        allocated_claim(rest, "claim-b", list(ok.fit.all_devices))  # its own claim, written by the arbiter
        eventually(lambda: next(iter(ok.fit.all_devices)) in service.holders())
        client.confirm(ok.id)


NESTED = "[{0}].all(a, [{0}].all(b, [{0}].all(c, [{0}].all(d, a + b + c + d >= 0))))".format(
    ", ".join(str(i) for i in range(60))
)  # 13M steps: minutes of CEL


def test_a_costly_selector_is_cut_off_and_never_blocks_capacity(
    rest: Rest, node: tuple[NodeReservations, list[tuple[str, str]]]
) -> None:
    """Tried: one Reserve with a nested comprehension held the lock for 67.8 s and blocked Capacity."""
    service, _ = node
    costly = Claim((DeviceRequest("x", selectors=(NESTED,)),))
    errors: list[grpc.RpcError] = []
    with channel(rest, service) as ch:
        client = GrpcNodeClient(ch, TOKEN, timeout_s=30)

        def reserve() -> None:
            try:
                client._rpc(client._stub.Reserve, claim_to_pb("g", "ns/pod/m", costly, 30))
            except grpc.RpcError as e:
                errors.append(e)
            except Exception as e:  # the client maps codes; keep the grpc error for the assertion
                errors.append(e.__cause__)  # type: ignore[arg-type]

        worker = threading.Thread(target=reserve)
        worker.start()
        answered = 0  # Capacity calls answered while the Reserve's selector was still running
        while worker.is_alive() and answered < 50:
            assert client.capacity().free_gpu_milli == 4000
            answered += worker.is_alive()
        worker.join(30)
        assert answered > 0
    assert not worker.is_alive()
    assert errors and errors[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the cost limit" in (errors[0].details() or "")
    assert service.book.live() == []


def test_a_costly_selector_stops_at_the_callers_deadline() -> None:
    from agent.reservation.selector_worker import SelectorTimeout, WorkerSelectors

    selectors = WorkerSelectors(per_evaluation_s=600)  # only the deadline can stop it
    try:
        started = time.monotonic()
        with pytest.raises(SelectorTimeout, match="deadline"):
            selectors.evaluate([NESTED], [{"driver": DRIVER, "attributes": {}, "capacity": {}}], 0.5)
        assert time.monotonic() - started < 10  # not the minutes the selector would take
        # the killed worker is replaced: the next call is answered
        answer = selectors.evaluate(["true"], [{"driver": DRIVER, "attributes": {}, "capacity": {}}], 30)
        assert answer.matches("true", {"driver": DRIVER, "attributes": {}, "capacity": {}})
    finally:
        selectors.close()


def test_a_selector_worker_killed_while_idle_is_replaced() -> None:
    from agent.reservation.selector_worker import WorkerSelectors

    device = {"driver": DRIVER, "attributes": {}, "capacity": {}}
    selectors = WorkerSelectors()
    try:
        assert selectors.evaluate(["true"], [device], 30).matches("true", device)
        [idle] = selectors._idle
        idle.proc.kill()  # e.g. the kernel's OOM killer
        idle.proc.wait()
        assert not selectors.evaluate(["false"], [device], 30).matches("false", device)
    finally:
        selectors.close()


def test_consumable_capacity_shares_take_their_fraction_and_keep_the_gpu_from_whole_claims(
    rest: Rest, node: tuple[NodeReservations, list[str]]
) -> None:
    service, _ = node
    memory = service._inventory().gpus[0].memory_bytes
    for i in range(9):
        claim = rest.create(
            RESOURCE_CLAIMS,
            "default",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": f"share-{i}"},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpu",
                                "exactly": {
                                    "deviceClassName": "gpu.nvidia.com",
                                    "capacity": {"requests": {"memory": "8Gi"}},
                                },
                            }
                        ]
                    }
                },
            },
        )
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": DRIVER,
                            "pool": NODE,
                            "device": "gpu-0",
                            "shareID": f"00000000-0000-4000-8000-00000000000{i}",
                            "consumedCapacity": {"memory": "8Gi"},
                        }
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                    ]
                },
            }
        }
        rest.replace(RESOURCE_CLAIMS, claim, "status")
    per_share = -(-8 * (1 << 30) * 1000 // memory)
    eventually(lambda: service.usage().shared_milli.get("gpu-0") == 9 * per_share)
    assert "gpu-0" not in service.usage().allocated
    with pytest.raises(NoFit):  # tried: every GPU whole while gpu-0 holds shares
        service.book.reserve("g", "m", gpus(4), 10)
    assert sorted(service.book.reserve("g", "m", gpus(3), 10).fit.devices["gpus"]) == ["gpu-1", "gpu-2", "gpu-3"]
