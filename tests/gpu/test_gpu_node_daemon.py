"""On a GPU machine (opt-in: `.venv/bin/pytest tests/gpu -m gpu`): the real `gpu-dra-agent node` daemon on real
NVML and the machine's driver root, as the kubelet and the API server see it.

The daemon runs as a subprocess (`--nvml real --driver-root /`) against the API fake; a kubelet (the fake, over
the daemon's real sockets) registers it, prepares a claim for the last whole GPU, watches device health and
unprepares. The ResourceSlices made from the real GPUs must pass the official strict schema of every supported
server version, and SIGTERM must end the daemon cleanly. Read-only on the GPU: nothing is reconfigured.
"""

from __future__ import annotations

from collections.abc import Iterator

import kubernetes_validate
import pytest
import yaml

import fakes.apiserver
from agent.kubelet import Health
from fakes.kubelet import FakeKubelet
from tests.gpu.test_gpu_cuda_container import real_nvml_or_skip
from tests.integration.test_node_support import (
    DRIVER,
    Daemon,
    allocate_claim,
    cdi_file,
    create_node,
    running,
    short_tmpdir,
)

pytestmark = pytest.mark.gpu
SERVER_VERSIONS = ("1.34", "1.35", "1.36", "1.37")


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        create_node(srv.api_client())
        yield srv


def test_the_daemon_publishes_prepares_and_reports_health_on_real_gpus(server: fakes.apiserver.ApiServer) -> None:
    real_nvml_or_skip()
    with short_tmpdir("gpu-node-") as root:
        check(
            server,
            Daemon(
                root, server.write_kubeconfig(root / "kubeconfig"), machine="real", extra_args=("--driver-root", "/")
            ),
        )


def check(server: fakes.apiserver.ApiServer, daemon: Daemon) -> None:
    with running(daemon), FakeKubelet(daemon.kubelet_root) as kubelet:
        kubelet.wait_for_driver(DRIVER)
        slices = server.store.objects("ResourceSlice")
        assert slices, "no ResourceSlice was published"
        for s in slices:
            for version in SERVER_VERSIONS:
                assert kubernetes_validate.validate(s, version, strict=True) is not None
        devices = [d for s in slices for d in s["spec"]["devices"]]
        whole = [d for d in devices if d["attributes"]["type"]["string"] == "gpu"]
        print(yaml.safe_dump(whole[-1]))  # on record with the run's output
        name = whole[-1]["name"]

        watch = kubelet.watch_health(DRIVER, timeout=30)
        try:
            first = next(iter(watch))
            assert {(h.device, h.health) for h in first} >= {(name, Health.HEALTHY)}
        finally:
            watch.cancel()

        ref = allocate_claim(server.api_client(), "daemon-check", [name])
        result = kubelet.prepare(DRIVER, [ref])[ref.uid]
        assert result.error == ""
        spec = cdi_file(daemon.cdi_root, ref)
        text = spec.read_text()
        assert "NVIDIA_VISIBLE_DEVICES=void" in text and "libcuda.so." in text
        assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
        assert not spec.exists()
        assert daemon.terminate() == 0
