"""The real `gpu-dra-agent node` daemon, as a subprocess, against the API fake and the kubelet fake:
what a cluster and a kubelet see of it, its metrics, its shutdown and its command-line errors."""

from __future__ import annotations

import json
import pathlib
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator

import kubernetes_validate
import pytest
from prometheus_client.parser import text_string_to_metric_families

import fakes.apiserver
from agent.claims.types import ClaimRef
from fakes.kubelet import FakeKubelet
from tests.fixtures.upstream_protos.client import UpstreamKubelet
from tests.integration.test_node_support import (
    DGX_H100_GPUS,
    DRIVER,
    NODE,
    Daemon,
    agent_command,
    allocate_claim,
    cdi_file,
    cdi_id,
    clean_env,
    create_node,
    fake_driver_root,
    running,
    short_tmpdir,
)

DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class Node:
    """An API server, the daemon and a kubelet, shared by the tests of this module (starting one takes seconds)."""

    def __init__(self, server: fakes.apiserver.ApiServer, daemon: Daemon, kubelet: FakeKubelet) -> None:
        self.server = server
        self.api = server.api_client()
        self.daemon = daemon
        self.kubelet = kubelet


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    with short_tmpdir("node-") as root, fakes.apiserver.start(port=0) as server:
        create_node(server.api_client())
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        with running(daemon), FakeKubelet(daemon.kubelet_root) as kubelet:
            kubelet.wait_for_driver(DRIVER)
            yield Node(server, daemon, kubelet)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the metrics endpoint by (name, sorted labels)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_slices_are_published_and_valid(node: Node) -> None:
    slices = node.server.store.objects("ResourceSlice")
    assert slices, "no ResourceSlice was published"
    node_uid = node.server.store.get("Node", NODE)["metadata"]["uid"]  # type: ignore[index]
    devices = []
    for s in slices:
        # the official 1.34 strict schema, independent of the API fake's own checks
        assert kubernetes_validate.validate(s, "1.34", strict=True) is not None
        spec = s["spec"]
        assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (DRIVER, NODE, NODE)
        assert spec["pool"]["resourceSliceCount"] == len(slices)
        assert len(spec["devices"]) <= 128
        assert s["metadata"]["ownerReferences"][0]["uid"] == node_uid
        devices += spec["devices"]
    names = [d["name"] for d in devices]
    assert sorted(names) == sorted(f"gpu-{i}" for i in range(DGX_H100_GPUS))
    assert all(DNS_LABEL.fullmatch(n) for n in names)
    assert {d["attributes"]["productName"]["string"] for d in devices} == {"NVIDIA H100 80GB HBM3"}
    # one NVLink domain (NVSwitch) on a DGX H100: every GPU carries the same value
    assert len({d["attributes"]["nvlinkDomain"]["string"] for d in devices}) == 1


def test_prepare_and_unprepare_a_claim(node: Node) -> None:
    ref = allocate_claim(node.api, "one-gpu", ["gpu-0"])
    result = node.kubelet.prepare(DRIVER, [ref])[ref.uid]
    assert result.error == ""
    [device] = result.devices
    assert (device.pool_name, device.device_name, device.request_names) == (NODE, "gpu-0", ("gpu",))
    assert device.cdi_device_ids == (cdi_id(ref, "gpu-0"),)
    spec = cdi_file(node.daemon.cdi_root, ref)
    assert spec.exists()
    assert "/dev/nvidia0" in spec.read_text()

    # the kubelet retries prepare after its own restart: the same answer, no second spec
    assert node.kubelet.prepare(DRIVER, [ref])[ref.uid] == result

    assert node.kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
    assert not spec.exists()


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> UpstreamKubelet:
    return UpstreamKubelet(tmp_path_factory.mktemp("upstream-protos"))


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_client_from_upstream_protos_registers_and_prepares(
    node: Node, upstream: UpstreamKubelet, version: str
) -> None:
    """A kubelet built from the verbatim upstream protos, not ours, against the running daemon."""
    info = upstream.get_info(node.daemon.registration_socket)
    assert (info.type, info.name, info.endpoint) == ("DRAPlugin", DRIVER, str(node.daemon.dra_socket))
    assert f"{version}.DRAPlugin" in info.supported_versions
    upstream.notify(node.daemon.registration_socket, registered=True)

    ref = allocate_claim(node.api, f"upstream-{version}", ["gpu-3"])
    claims = [(ref.namespace, ref.uid, ref.name)]
    response = upstream.prepare(info.endpoint, version, claims)
    assert type(response).DESCRIPTOR.full_name == f"k8s.io.kubelet.pkg.apis.dra.{version}.NodePrepareResourcesResponse"
    entry = response.claims[ref.uid]
    assert entry.error == ""
    assert [(list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids)) for d in entry.devices] == [
        (["gpu"], NODE, "gpu-3", [cdi_id(ref, "gpu-3")])
    ]
    assert cdi_file(node.daemon.cdi_root, ref).exists()
    assert upstream.unprepare(info.endpoint, version, claims).claims[ref.uid].error == ""
    assert not cdi_file(node.daemon.cdi_root, ref).exists()


def test_unprepare_of_an_unknown_claim_succeeds(node: Node) -> None:
    ghost = ClaimRef("default", "00000000-0000-0000-0000-00000000dead", "never-prepared")
    assert node.kubelet.unprepare(DRIVER, [ghost]) == {ghost.uid: ""}


def test_claim_for_another_nodes_pool_fails_alone(node: Node) -> None:
    # tried: a batch where one claim was allocated on node-b; only that claim may fail
    elsewhere = allocate_claim(node.api, "on-node-b", ["gpu-1"], pool="node-b")
    good = allocate_claim(node.api, "on-this-node", ["gpu-2"])
    results = node.kubelet.prepare(DRIVER, [elsewhere, good])
    assert "no device of driver gpu.nvidia.com in pool node-a" in results[elsewhere.uid].error
    assert results[elsewhere.uid].devices == ()
    assert results[good.uid].error == ""
    assert [d.cdi_device_ids for d in results[good.uid].devices] == [(cdi_id(good, "gpu-2"),)]
    assert not cdi_file(node.daemon.cdi_root, elsewhere).exists()
    assert node.kubelet.unprepare(DRIVER, [good]) == {good.uid: ""}


def test_metrics_follow_prepare_and_unprepare(node: Node) -> None:
    url = node.daemon.metrics_url()
    before = scrape(url)
    prepare_count = ("gpu_dra_prepare_duration_seconds_count", (("operation", "prepare"),))
    refs = [allocate_claim(node.api, f"metrics-{i}", [f"gpu-{4 + i}"]) for i in range(2)]
    assert not any(r.error for r in node.kubelet.prepare(DRIVER, refs).values())

    during = scrape(url)
    assert during[prepare_count] == before.get(prepare_count, 0) + 1  # one call, however many claims
    assert during[("gpu_dra_prepared_claims", ())] == before[("gpu_dra_prepared_claims", ())] + 2
    assert during[("gpu_dra_published_devices", ())] == DGX_H100_GPUS

    node.kubelet.unprepare(DRIVER, refs)
    assert scrape(url)[("gpu_dra_prepared_claims", ())] == before[("gpu_dra_prepared_claims", ())]


def test_sigterm_exits_cleanly_and_removes_sockets() -> None:
    with short_tmpdir("node-") as root, fakes.apiserver.start(port=0) as server:
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        with running(daemon):
            assert daemon.registration_socket.is_socket() and daemon.dra_socket.is_socket()
            assert daemon.registration_socket.stat().st_mode & 0o077 == 0  # owner-only
            assert daemon.terminate() == 0
            assert not daemon.registration_socket.exists()
            assert not daemon.dra_socket.exists()


def _pool_slices(server: fakes.apiserver.ApiServer, pool: str) -> list[str]:
    url = f"{server.url}/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3D{pool}"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return [s["metadata"]["name"] for s in json.load(answer)["items"]]


@pytest.mark.parametrize("node_exists", [False, True])
def test_stop_withdraws_slices_only_when_no_node_owns_them(node_exists: bool) -> None:
    with short_tmpdir("node-") as root, fakes.apiserver.start(port=0) as server:
        if node_exists:
            create_node(server.api_client())
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        with running(daemon):
            assert _pool_slices(server, NODE)
            assert daemon.proc is not None
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.proc.send_signal(signal.SIGTERM)  # a second SIGTERM while stopping
            assert daemon.proc.wait(10) == 0
        received = [r for r in daemon.logs() if str(r.get("msg", "")).startswith("received")]
        assert len(received) == 1, received
        # Ownerless slices would never be garbage-collected; owned ones stay for the restarted agent.
        assert bool(_pool_slices(server, NODE)) is node_exists


def run_cli(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    driver_root = fake_driver_root(cwd)
    return subprocess.run(
        agent_command("--driver-root", str(driver_root), *args),
        check=False,
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        cwd=cwd,
    )


def test_missing_node_name_is_a_usage_error(tmp_path: pathlib.Path) -> None:
    # tried: starting the daemon with neither --node-name nor NODE_NAME
    done = run_cli("--nvml", "fake:dgx-h100", "--state-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2
    assert "--node-name (or NODE_NAME) is required" in done.stderr


@pytest.mark.parametrize(
    ("nvml", "says"),
    [
        ("bogus", "--nvml must be 'real' or 'fake:<machine>'"),
        ("fake:no-such-machine", "unknown fake NVML machine 'no-such-machine'"),
    ],
)
def test_bad_nvml_is_one_sentence(tmp_path: pathlib.Path, nvml: str, says: str) -> None:
    # tried: an --nvml value that names no NVML source
    done = run_cli("--node-name", NODE, "--nvml", nvml, "--state-dir", str(tmp_path), cwd=tmp_path)
    assert done.returncode == 2  # a setting that cannot work
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one sentence, no traceback
    assert says in lines[0]
