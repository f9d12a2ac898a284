"""The kubelet-facing servicers, called directly (no sockets) with an in-memory Preparer."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from agent._proto.kubelet import dra_health_v1alpha1_pb2 as health_pb
from agent._proto.kubelet import dra_v1_pb2, dra_v1beta1_pb2
from agent._proto.kubelet import pluginregistration_v1_pb2 as reg_pb
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.kubelet import KubeletPlugin, RegistrationFailed
from agent.kubelet.dra import ClaimService, DRAPluginServicer
from agent.kubelet.health import DeviceHealth, Health, HealthSource
from agent.kubelet.registration import SUPPORTED_VERSIONS, RegistrationServicer
from agent.kubelet.resource_health import to_message
from agent.kubelet.sockets import SocketError, check_socket_path, remove_stale
from fakes.kubelet import InMemoryPreparer

A = ClaimRef("default", "uid-a", "claim-a")
B = ClaimRef("default", "uid-b", "claim-b")


def test_prepare_returns_each_claims_devices_and_errors_separately():
    preparer = InMemoryPreparer(devices_per_claim=2, fail={"uid-b": "device gpu-3 is unhealthy"})
    results = ClaimService(preparer).prepare([A, B])
    assert [d.device_name for d in results["uid-a"].devices] == ["gpu-0", "gpu-1"]
    assert results["uid-a"].error == ""
    assert results["uid-b"] == PrepareResult(error="device gpu-3 is unhealthy")


def test_devices_of_a_failed_claim_are_not_sent():
    class HalfDone:
        def prepare(self, claims, timeout=None):
            device = PreparedDevice(("gpu",), "node-a", "gpu-0", ("k8s.gpu.nvidia.com/claim=x-gpu-0",))
            return {c.uid: PrepareResult(devices=(device,), error="CDI write failed") for c in claims}

        def unprepare(self, claims):
            return {}

    assert ClaimService(HalfDone()).prepare([A]) == {"uid-a": PrepareResult(error="CDI write failed")}


def test_a_preparer_that_raises_fails_every_claim_of_the_batch_but_not_the_call():
    service = ClaimService(InMemoryPreparer(raises=RuntimeError("checkpoint is corrupted")))
    results = service.prepare([A, B])
    assert set(results) == {"uid-a", "uid-b"}
    for result in results.values():
        assert result.devices == ()
        assert result.error == "prepare failed: RuntimeError: checkpoint is corrupted"
    assert service.unprepare([A]) == {"uid-a": "unprepare failed: RuntimeError: checkpoint is corrupted"}


def test_a_claim_the_preparer_forgot_gets_an_error():
    class Forgetful:
        def prepare(self, claims, timeout=None):
            return {}

        def unprepare(self, claims):
            return {}

    service = ClaimService(Forgetful())
    assert service.prepare([A])["uid-a"].error == "prepare: the driver returned no result"
    assert service.unprepare([A])["uid-a"] == "unprepare: the driver returned no result"


def test_claims_missing_identity_are_refused_without_reaching_the_preparer():
    preparer = InMemoryPreparer()
    results = ClaimService(preparer).prepare([ClaimRef("", "uid-c", "c"), A])
    assert results["uid-c"].error == "prepare: claim /c lacks namespace"
    assert results["uid-a"].error == ""
    assert preparer.calls == [("prepare", ("uid-a",))]


@pytest.mark.parametrize("uid", ["x/../y", "a\0b", "u" * 256])
def test_a_claim_with_a_uid_unfit_for_a_path_is_refused_alone(uid, caplog):
    # Tried: a path, a NUL byte, 256 characters; the valid claim beside it is prepared.
    preparer = InMemoryPreparer()
    with caplog.at_level("WARNING"):
        results = ClaimService(preparer).prepare([ClaimRef("default", uid, "c"), A])
    assert "claim UID" in results[uid].error
    assert results["uid-a"].error == ""
    assert preparer.calls == [("prepare", ("uid-a",))]
    assert [r.levelname for r in caplog.records if "claim UID" in r.getMessage()] == ["WARNING"]


def test_a_repeated_claim_is_prepared_once_and_an_empty_batch_not_at_all():
    preparer = InMemoryPreparer()
    service = ClaimService(preparer)
    assert set(service.prepare([A, A])) == {"uid-a"}
    assert service.prepare([]) == {}
    assert preparer.calls == [("prepare", ("uid-a",))]


class Deadline:
    """The part of a grpc.ServicerContext the DRA servicer reads."""

    def __init__(self, remaining=None):
        self.remaining = remaining

    def time_remaining(self):
        return self.remaining


def test_the_calls_deadline_less_a_margin_reaches_the_preparer():
    seen = []

    class Timed(InMemoryPreparer):
        def prepare(self, claims, timeout=None):
            seen.append(timeout)
            return super().prepare(claims, timeout)

    servicer = DRAPluginServicer(ClaimService(Timed()), dra_v1_pb2)
    request = dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="ns", uid="u", name="c")])
    servicer.NodePrepareResources(request, Deadline(45.0))
    servicer.NodePrepareResources(request, Deadline(0.2))  # too late to do anything: no time, not negative
    servicer.NodePrepareResources(request, Deadline(None))
    assert seen == [44.0, 0.0, None]


def test_an_unprepare_is_not_queued_behind_a_slow_prepare():
    # Tried: a prepare stuck (as on a stalled API server) while the kubelet unprepares another claim.
    release = threading.Event()

    class Stuck(InMemoryPreparer):
        def prepare(self, claims, timeout=None):
            release.wait(10)
            return super().prepare(claims, timeout)

    service = ClaimService(Stuck())
    stuck = threading.Thread(target=service.prepare, args=([A],))
    stuck.start()
    try:
        assert service.unprepare([B]) == {"uid-b": ""}  # served now, not after the prepare
        assert stuck.is_alive()
    finally:
        release.set()
        stuck.join()


@pytest.mark.parametrize("api", [dra_v1_pb2, dra_v1beta1_pb2], ids=["v1", "v1beta1"])
def test_servicer_translates_both_api_versions(api):
    servicer = DRAPluginServicer(ClaimService(InMemoryPreparer(fail={"uid-b": "no such device"})), api)
    request = api.NodePrepareResourcesRequest(
        claims=[
            api.Claim(namespace="default", uid="uid-a", name="claim-a"),
            api.Claim(namespace="default", uid="uid-b", name="claim-b"),
        ]
    )
    response = servicer.NodePrepareResources(request, Deadline())
    assert isinstance(response, api.NodePrepareResourcesResponse)
    device = response.claims["uid-a"].devices[0]
    assert (list(device.request_names), device.pool_name, device.device_name, list(device.cdi_device_ids)) == (
        ["gpu"],
        "node-a",
        "gpu-0",
        ["k8s.gpu.nvidia.com/claim=uid-a-gpu-0"],
    )
    assert response.claims["uid-b"].error == "no such device"
    assert not response.claims["uid-b"].devices

    unprepared = servicer.NodeUnprepareResources(
        api.NodeUnprepareResourcesRequest(claims=[api.Claim(namespace="default", uid="uid-a", name="claim-a")]),
        None,
    )
    assert isinstance(unprepared, api.NodeUnprepareResourcesResponse)
    assert dict(unprepared.claims) == {"uid-a": api.NodeUnprepareResourceResponse(error="")}


def test_registration_info_and_status():
    endpoint = "/k/plugins/gpu.nvidia.com/dra.sock"
    servicer = RegistrationServicer("gpu.nvidia.com", endpoint, SUPPORTED_VERSIONS)
    info = servicer.GetInfo(reg_pb.InfoRequest(), None)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", "gpu.nvidia.com", endpoint)
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]

    assert servicer.status is None
    assert servicer.wait(timeout=0.01) is None  # the kubelet has not answered yet
    servicer.NotifyRegistrationStatus(reg_pb.RegistrationStatus(plugin_registered=True), None)
    assert servicer.wait(timeout=0.01).registered


def test_a_rejected_registration_is_surfaced():
    servicer = RegistrationServicer("gpu.nvidia.com", "/x.sock", SUPPORTED_VERSIONS)
    servicer.NotifyRegistrationStatus(
        reg_pb.RegistrationStatus(plugin_registered=False, error="endpoint already registered"), None
    )
    assert servicer.status.error == "endpoint already registered"
    with pytest.raises(RegistrationFailed, match="endpoint already registered"):
        servicer.wait(timeout=0.01)


def test_health_source_versions_only_real_changes():
    source = HealthSource()
    source.set("node-a", "gpu-0", Health.HEALTHY, now=100)
    first = source.snapshot()
    source.set("node-a", "gpu-0", Health.HEALTHY, now=200)  # same health: not a change
    assert source.snapshot() == first
    source.set("node-a", "gpu-0", Health.UNHEALTHY, now=300)
    assert source.snapshot().version > first.version
    assert source.snapshot().devices == (DeviceHealth("node-a", "gpu-0", Health.UNHEALTHY, 300),)
    source.replace([DeviceHealth("node-a", "gpu-1", Health.UNKNOWN, 400)])
    assert [d.device for d in source.snapshot().devices] == ["gpu-1"]


def test_health_watchers_wake_on_change_and_on_stop():
    source = HealthSource()
    assert source.wait_newer(0, timeout=0.01) is None
    seen: list[object] = []
    waiter = threading.Thread(target=lambda: seen.append(source.wait_newer(0, timeout=5)))
    waiter.start()
    source.set("node-a", "gpu-0", Health.HEALTHY, now=1)
    waiter.join(timeout=5)
    assert seen and seen[0].devices[0].device == "gpu-0"

    stop = threading.Event()
    waiter = threading.Thread(target=lambda: seen.append(source.wait_newer(1, timeout=5, stop=stop.is_set)))
    waiter.start()
    stop.set()
    source.wake_all()
    waiter.join(timeout=1)
    assert not waiter.is_alive() and seen[-1] is None


def test_health_message_uses_the_wire_enum():
    source = HealthSource()
    source.set("node-a", "gpu-1", Health.UNHEALTHY, now=1700000000)
    source.set("node-a", "gpu-0", Health.HEALTHY, now=1700000001)
    message = to_message(source.snapshot())
    assert [(d.device.device_name, d.health, d.last_updated_time) for d in message.devices] == [
        ("gpu-0", health_pb.HEALTHY, 1700000001),
        ("gpu-1", health_pb.UNHEALTHY, 1700000000),
    ]


def test_socket_paths_the_kernel_cannot_bind_are_refused(tmp_path):
    with pytest.raises(SocketError, match="longer than 107 bytes"):
        check_socket_path(Path("/" + "k" * 120) / "dra.sock")
    with pytest.raises(SocketError, match="must be absolute"):
        check_socket_path(Path("relative/dra.sock"))


def test_a_regular_file_in_the_socket_place_is_not_deleted(tmp_path):
    squatter = tmp_path / "dra.sock"
    squatter.write_text("not a socket")
    with pytest.raises(SocketError, match="not a socket"):
        remove_stale(squatter)
    assert squatter.read_text() == "not a socket"


@pytest.mark.parametrize("name", ["GPU.nvidia.com", "gpu_nvidia", "-gpu.com", "a" * 64, "gpu/../x"])
def test_invalid_driver_names_are_refused(name):
    with pytest.raises(ValueError, match="not a DNS subdomain"):
        KubeletPlugin(name, "/tmp/k", InMemoryPreparer())


@pytest.mark.parametrize("versions", [(), ("v2.DRAPlugin",), ("v1alpha1.DRAResourceHealth",)])
def test_only_known_dra_versions_can_be_advertised(versions):
    with pytest.raises(ValueError, match="dra_versions"):
        KubeletPlugin("gpu.nvidia.com", "/tmp/k", InMemoryPreparer(), dra_versions=versions)
