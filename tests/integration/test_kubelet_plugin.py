"""The kubelet plugin over real unix sockets, driven by the kubelet fake."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agent._proto.kubelet import dra_v1beta1_pb2, dra_v1beta1_pb2_grpc, pluginregistration_v1_pb2_grpc
from agent.claims.types import ClaimRef
from agent.kubelet import Health, HealthSource, KubeletPlugin, RegistrationFailed, sockets
from agent.kubelet.dra import ClaimService, DRAPluginServicer
from agent.kubelet.registration import RegistrationServicer
from fakes.kubelet import FakeKubelet, InMemoryPreparer, KubeletError, Retry
from fakes.kubelet.kubelet import V1, V1BETA1

DRIVER = "gpu.nvidia.com"
A = ClaimRef("default", "uid-a", "claim-a")
B = ClaimRef("default", "uid-b", "claim-b")


@pytest.fixture
def root():
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    path = Path(tempfile.mkdtemp(prefix="kl-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def preparer():
    return InMemoryPreparer(devices_per_claim=2, fail={"uid-b": "device gpu-9 does not exist"})


@pytest.fixture
def plugin(root, preparer):
    health = HealthSource()
    health.set("node-a", "gpu-0", Health.HEALTHY, now=1000)
    plugin = KubeletPlugin(DRIVER, root, preparer, health)
    plugin.start()
    yield plugin
    plugin.stop(grace=0)


@pytest.fixture
def kubelet(root):
    with FakeKubelet(root, retry=Retry(attempts=3, initial_backoff=0.01)) as kubelet:
        yield kubelet


def test_registration_and_socket_layout(root, plugin, kubelet):
    assert kubelet.scan() == [DRIVER]
    registered = kubelet.plugin(DRIVER)
    assert registered.registration_socket == root / "plugins_registry" / "gpu.nvidia.com-reg.sock"
    assert registered.endpoint == root / "plugins" / "gpu.nvidia.com" / "dra.sock"
    assert registered.api == V1 and registered.health_api == "v1.DRAResourceHealth"  # the most recent offered
    assert plugin.wait_registered(timeout=5).registered
    for path in (plugin.registration_socket, plugin.dra_socket):
        mode = path.stat().st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) & 0o177 == 0, f"{path} is {oct(stat.S_IMODE(mode))}, wanted 0600 or tighter"


def test_prepare_and_unprepare_through_the_socket(plugin, kubelet, preparer):
    kubelet.scan()
    results = kubelet.prepare(DRIVER, [A, B])
    assert [d.device_name for d in results["uid-a"].devices] == ["gpu-0", "gpu-1"]
    assert results["uid-a"].devices[0].cdi_device_ids == ("k8s.gpu.nvidia.com/claim=uid-a-gpu-0",)
    assert results["uid-b"].error == "device gpu-9 does not exist"
    assert kubelet.prepare(DRIVER, [A]) == {"uid-a": results["uid-a"]}  # idempotent repeat
    assert kubelet.unprepare(DRIVER, [A, ClaimRef("default", "never-prepared", "x")]) == {
        "uid-a": "",
        "never-prepared": "",
    }
    assert preparer.prepared == {}


def test_one_call_per_driver_per_pod(plugin, kubelet, preparer):
    kubelet.scan()
    kubelet.prepare_pod({DRIVER: [A, ClaimRef("default", "uid-c", "claim-c")]})
    assert preparer.calls == [("prepare", ("uid-a", "uid-c"))]


def test_a_raising_preparer_yields_per_claim_errors_not_a_failed_call(root, kubelet):
    with KubeletPlugin(DRIVER, root, InMemoryPreparer(raises=OSError(28, "No space left on device"))):
        kubelet.scan()
        results = kubelet.prepare(DRIVER, [A, B])
    assert {uid: r.error for uid, r in results.items()} == {
        uid: "prepare failed: OSError: [Errno 28] No space left on device" for uid in ("uid-a", "uid-b")
    }


def test_a_v1beta1_kubelet_is_served_too(root, plugin, preparer):
    with FakeKubelet(root, versions=(V1BETA1,)) as old_kubelet:
        old_kubelet.scan()
        assert old_kubelet.plugin(DRIVER).api == V1BETA1
        results = old_kubelet.prepare(DRIVER, [A])
    assert [d.device_name for d in results["uid-a"].devices] == ["gpu-0", "gpu-1"]


def test_a_plugin_offering_only_v1beta1_is_called_with_v1beta1(root, preparer):
    with KubeletPlugin(DRIVER, root, preparer, dra_versions=(V1BETA1,)), FakeKubelet(root) as kubelet:
        kubelet.scan()
        assert kubelet.plugin(DRIVER).versions == (V1BETA1,)
        assert kubelet.plugin(DRIVER).api == V1BETA1
        assert kubelet.prepare(DRIVER, [A])["uid-a"].error == ""


def test_a_plugin_advertising_v1_but_not_serving_it_fails_prepare(root, preparer):
    # A plugin built by hand: registration says v1 and v1beta1, the endpoint serves only v1beta1. The 1.37
    # kubelet keeps the service it chose at registration (no fallback): the pod's prepare fails.
    endpoint = root / "plugins" / DRIVER / "dra.sock"
    registration = RegistrationServicer(DRIVER, str(endpoint), (V1, V1BETA1))
    server = grpc.server(futures.ThreadPoolExecutor(2))
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
        DRAPluginServicer(ClaimService(preparer), dra_v1beta1_pb2), server
    )
    pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(registration, server)
    sockets.bind(server, endpoint)
    sockets.bind(server, root / "plugins_registry" / f"{DRIVER}-reg.sock")
    server.start()
    try:
        with FakeKubelet(root) as kubelet:
            kubelet.scan()
            assert kubelet.plugin(DRIVER).api == V1
            with pytest.raises(KubeletError, match="NodePrepareResources for driver .*: UNIMPLEMENTED"):
                kubelet.prepare(DRIVER, [A])
            assert kubelet.plugin(DRIVER).api == V1
    finally:
        server.stop(0).wait()


def test_the_plugin_s_order_of_services_decides_which_the_kubelet_calls(root, preparer):
    # The kubelet takes the first advertised service it speaks, so a plugin listing v1beta1 first gets v1beta1.
    with KubeletPlugin(DRIVER, root, preparer, dra_versions=(V1BETA1, V1)), FakeKubelet(root) as kubelet:
        kubelet.scan()
        assert kubelet.plugin(DRIVER).api == V1BETA1
        assert kubelet.prepare(DRIVER, [A])["uid-a"].error == ""


def test_a_kubelet_that_speaks_no_offered_version_rejects_the_plugin(root, plugin):
    with FakeKubelet(root, versions=("v2.DRAPlugin",)) as kubelet:
        assert kubelet.scan() == []
        assert "none of the versions" in kubelet.rejected[plugin.registration_socket]
    with pytest.raises(RegistrationFailed, match="none of the versions"):
        plugin.wait_registered(timeout=5)


def test_stop_removes_sockets_and_the_kubelet_forgets_the_plugin(plugin, kubelet):
    kubelet.scan()
    plugin.stop(grace=0)
    assert not plugin.registration_socket.exists()
    assert not plugin.dra_socket.exists()
    kubelet.scan()
    with pytest.raises(KubeletError, match="not registered"):
        kubelet.prepare(DRIVER, [A])


def test_a_stale_socket_from_a_crash_is_replaced(root, preparer, kubelet):
    stale = root / "plugins" / DRIVER / "dra.sock"
    stale.parent.mkdir(parents=True)
    leftover = socket.socket(socket.AF_UNIX)
    leftover.bind(str(stale))
    leftover.close()  # the file stays, nobody listens: what a killed plugin leaves behind
    with KubeletPlugin(DRIVER, root, preparer):
        kubelet.scan()
        assert kubelet.prepare(DRIVER, [A])["uid-a"].error == ""


def test_stopping_an_old_plugin_leaves_its_successors_sockets_alone(root, preparer, kubelet):
    """Tried: a rolling update that starts the new agent before the old one stops (maxSurge). The old
    agent's stop must not delete the sockets the new one now serves, or the kubelet loses the driver."""
    old = KubeletPlugin(DRIVER, root, preparer)
    old.start()
    with KubeletPlugin(DRIVER, root, preparer) as new:
        old.stop(grace=0)
        assert new.registration_socket.exists() and new.dra_socket.exists()
        kubelet.scan()
        assert kubelet.prepare(DRIVER, [A])["uid-a"].error == ""
    assert not (root / "plugins" / DRIVER / "dra.sock").exists()


def test_transient_unavailability_is_retried(root, preparer):
    plugin = KubeletPlugin(DRIVER, root, preparer)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        time.sleep(seconds)
        if len(slept) == 2:
            plugin.start()  # the plugin comes back while the kubelet backs off

    with FakeKubelet(root, retry=Retry(attempts=8, initial_backoff=0.05), sleep=sleep) as kubelet:
        with plugin:
            kubelet.scan()
        results = kubelet.prepare(DRIVER, [A])
        plugin.stop(grace=0)
    assert results["uid-a"].error == ""
    assert slept[:2] == [0.05, 0.1]


def test_retries_give_up_with_a_clear_error(root, preparer):
    with FakeKubelet(root, retry=Retry(attempts=2, initial_backoff=0.01)) as kubelet:
        with KubeletPlugin(DRIVER, root, preparer):
            kubelet.scan()
        with pytest.raises(KubeletError, match="NodePrepareResources for driver gpu.nvidia.com: UNAVAILABLE"):
            kubelet.prepare(DRIVER, [A])


def test_health_stream_sends_the_full_list_then_changes(root, preparer, kubelet):
    health = HealthSource()
    health.set("node-a", "gpu-0", Health.HEALTHY, now=1000)
    health.set("node-a", "gpu-1", Health.HEALTHY, now=1000)
    with KubeletPlugin(DRIVER, root, preparer, health):
        kubelet.scan()
        watch = kubelet.watch_health(DRIVER, timeout=10)
        first = next(watch)
        assert [(d.device, d.health) for d in first] == [("gpu-0", Health.HEALTHY), ("gpu-1", Health.HEALTHY)]
        health.set("node-a", "gpu-1", Health.UNHEALTHY, now=1010)
        second = next(watch)
        assert [(d.device, d.health, d.last_updated) for d in second] == [
            ("gpu-0", Health.HEALTHY, 1000),
            ("gpu-1", Health.UNHEALTHY, 1010),
        ]
        watch.cancel()


def test_stop_ends_open_health_streams_without_waiting_out_the_grace(root, preparer, kubelet):
    plugin = KubeletPlugin(DRIVER, root, preparer, HealthSource())
    plugin.start()
    kubelet.scan()
    watch = kubelet.watch_health(DRIVER, timeout=30)
    assert next(watch) == ()
    started = time.monotonic()
    plugin.stop(grace=10)
    assert time.monotonic() - started < 5, "stop() waited on an open health stream"
    with pytest.raises(StopIteration):  # the stream ended cleanly; the kubelet reopens it later
        next(watch)


def test_without_a_health_source_the_health_service_is_not_offered(root, preparer, kubelet):
    with KubeletPlugin(DRIVER, root, preparer) as plugin:
        kubelet.scan()
        assert not [v for v in plugin.supported_versions if v.endswith(".DRAResourceHealth")]
        with pytest.raises(KubeletError, match="offers none of .*DRAResourceHealth"):
            kubelet.watch_health(DRIVER)


def test_grpc_health_on_the_dra_socket_and_the_tcp_liveness_port(root, preparer):
    with KubeletPlugin(DRIVER, root, preparer, liveness_address="127.0.0.1:0") as plugin:
        request = health_pb2.HealthCheckRequest(service="liveness")
        for target in (f"unix:{plugin.dra_socket}", f"127.0.0.1:{plugin.liveness_port}"):
            with grpc.insecure_channel(target) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, target
        assert preparer.calls == []  # the liveness probe's empty prepare never reaches the driver
        plugin.dra_socket.unlink()  # the kubelet could no longer reach us
        with grpc.insecure_channel(f"127.0.0.1:{plugin.liveness_port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


SIGTERM_CHILD = textwrap.dedent(
    """
    import signal, sys, threading
    from agent.kubelet import KubeletPlugin
    from fakes.kubelet import InMemoryPreparer

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    plugin = KubeletPlugin("gpu.nvidia.com", sys.argv[1], InMemoryPreparer())
    plugin.start()
    print("ready", flush=True)
    done.wait()
    plugin.stop()
    print("stopped", flush=True)
    """
)


def test_sigterm_stop_removes_the_sockets(root):
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_CHILD, str(root)],
        cwd=repo,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        sockets = [root / "plugins_registry" / "gpu.nvidia.com-reg.sock", root / "plugins" / DRIVER / "dra.sock"]
        assert all(p.exists() for p in sockets)
        child.terminate()
        assert child.wait(timeout=10) == 0
        assert child.stdout.read().strip() == "stopped"
        assert not any(p.exists() for p in sockets)
    finally:
        child.kill()
        child.wait()


def test_a_second_plugin_claiming_the_same_endpoint_is_rejected(root, plugin, kubelet):
    assert kubelet.scan() == [DRIVER]
    impostor = RegistrationServicer("other.example.com", str(plugin.dra_socket), (V1,))
    server = grpc.server(futures.ThreadPoolExecutor(1))
    pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(impostor, server)
    impostor_socket = root / "plugins_registry" / "other.example.com-reg.sock"
    sockets.bind(server, impostor_socket)
    server.start()
    try:
        assert kubelet.scan() == []
        assert "already registered for driver gpu.nvidia.com" in kubelet.rejected[impostor_socket]
        with pytest.raises(RegistrationFailed):
            impostor.wait(timeout=5)
    finally:
        server.stop(0).wait()


def test_the_watcher_registers_and_forgets_plugins_as_sockets_come_and_go(root, preparer, kubelet):
    kubelet.start(interval=0.01)
    with KubeletPlugin(DRIVER, root, preparer) as plugin:
        kubelet.wait_for_driver(DRIVER, timeout=10)
        assert plugin.wait_registered(timeout=10).registered
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            kubelet.plugin(DRIVER)
        except KubeletError:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the kubelet fake kept a plugin whose sockets are gone")


def test_open_health_streams_leave_workers_for_prepare(root, preparer, kubelet):
    # Tried: 16 open health streams (as many as the DRA socket once had workers), then one more, then a prepare.
    health = HealthSource()
    health.set("node-a", "gpu-0", Health.HEALTHY, now=1000)
    with KubeletPlugin(DRIVER, root, preparer, health, max_workers=16, max_health_streams=16):
        kubelet.scan()
        watches = [kubelet.watch_health(DRIVER, timeout=60) for _ in range(16)]
        try:
            for watch in watches:
                assert [d.device for d in next(watch)] == ["gpu-0"]  # each stream is open and served
            extra = kubelet.watch_health(DRIVER, timeout=10)
            with pytest.raises(grpc.RpcError) as refused:
                next(extra)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "health streams" in refused.value.details()
            started = time.monotonic()
            assert kubelet.prepare(DRIVER, [A])["uid-a"].error == ""
            assert kubelet.unprepare(DRIVER, [A]) == {"uid-a": ""}
            assert time.monotonic() - started < 5
        finally:
            for watch in watches:
                watch.cancel()
        # Closed streams give their places back (once the server has seen the cancellations).
        deadline = time.monotonic() + 5
        while True:
            watch = kubelet.watch_health(DRIVER, timeout=10)
            try:
                assert [d.device for d in next(watch)] == ["gpu-0"]
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                time.sleep(0.05)
            finally:
                watch.cancel()
