"""A client compiled from the verbatim upstream kubelet protos (not ours) registers and prepares against the
running plugin: the proof that our hand-written protos are what the kubelet speaks."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import grpc
import pytest

from agent.kubelet import Health, HealthSource, KubeletPlugin
from fakes.kubelet import InMemoryPreparer
from tests.fixtures.upstream_protos.client import HEALTH, HEALTH_V1, UpstreamKubelet

DRIVER = "gpu.nvidia.com"


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    return UpstreamKubelet(tmp_path_factory.mktemp("upstream-protos"))


@pytest.fixture
def plugin():
    root = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    health = HealthSource()
    health.set("node-a", "gpu-0", Health.UNHEALTHY, now=1234, message="XID 79 (GPU has fallen off the bus)")
    preparer = InMemoryPreparer(fail={"uid-bad": "claim is not allocated"})
    with KubeletPlugin(DRIVER, root, preparer, health) as plugin:
        yield plugin
    shutil.rmtree(root, ignore_errors=True)


def test_upstream_client_registers(upstream, plugin):
    info = upstream.get_info(plugin.registration_socket)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(plugin.dra_socket))
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1.DRAResourceHealth",
        "v1alpha1.DRAResourceHealth",
    ]
    upstream.notify(plugin.registration_socket, registered=True)
    assert plugin.wait_registered(timeout=5).registered


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_upstream_client_prepares_and_unprepares(upstream, plugin, version):
    endpoint = upstream.get_info(plugin.registration_socket).endpoint
    claims = [("default", "uid-a", "claim-a"), ("default", "uid-bad", "claim-bad")]
    response = upstream.prepare(endpoint, version, claims)
    assert type(response).DESCRIPTOR.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.NodePrepareResourcesResponse"
    device = response.claims["uid-a"].devices[0]
    assert (list(device.request_names), device.pool_name, device.device_name, list(device.cdi_device_ids)) == (
        ["gpu"],
        "node-a",
        "gpu-0",
        ["k8s.gpu.nvidia.com/claim=uid-a-gpu-0"],
    )
    assert response.claims["uid-bad"].error == "claim is not allocated"

    unprepared = upstream.unprepare(endpoint, version, claims[:1])
    assert set(unprepared.claims) == {"uid-a"} and unprepared.claims["uid-a"].error == ""


@pytest.mark.parametrize("proto", [HEALTH, HEALTH_V1], ids=["v1alpha1", "v1"])
def test_upstream_client_watches_health(upstream, plugin, proto):
    with grpc.insecure_channel(f"unix:{plugin.dra_socket}") as channel:
        stream = upstream.watch_health(channel, proto)
        first = next(stream)
        stream.cancel()
    [device] = first.devices
    if proto == HEALTH_V1:  # v1 says why (v1alpha1 at 1.34 has no such field)
        assert device.message == "XID 79 (GPU has fallen off the bus)"
        assert type(first).DESCRIPTOR.full_name == "v1.NodeWatchResourcesResponse"
    assert (device.device.pool_name, device.device.device_name, device.last_updated_time) == ("node-a", "gpu-0", 1234)
    assert (
        device.health
        == type(first).DESCRIPTOR.file.enum_types_by_name["HealthStatus"].values_by_name["UNHEALTHY"].number
    )
