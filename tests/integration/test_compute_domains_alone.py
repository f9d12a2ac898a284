"""`gpu-dra-agent node --no-gpus --compute-domains`: a ComputeDomains-only node, as NVIDIA's chart installs with
resources.gpus.enabled=false (GPUs left to the GPU Operator's device plugin), on a fake GB200 NVL72 node.

The agent still discovers the GPUs through NVML (their fabric clique decides the channels) but serves no
gpu.nvidia.com: no GPU ResourceSlice, no GPU kubelet plugin socket, nothing on the Node's labels; it serves
compute-domain.nvidia.com in full: its slice, its kubelet plugin (which then answers the liveness probe), a
channel claim prepared with the domain's IMEX daemon, and channels withdrawn when the fabric breaks.
"""

from __future__ import annotations

import pathlib
import socket

import grpc
import pynvml as N
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import fakes.apiserver
from agent.computedomain.channels import channel_path
from agent.computedomain.model import DRIVER
from agent.kube.rest import COMPUTE_DOMAINS, NODES, RESOURCE_SLICES
from fakes.computedomains import wait_for
from fakes.kubelet import FakeKubelet
from fakes.nvml.control import FakeNvml
from fakes.nvml.machines import nvl72_node
from tests.integration.test_compute_domain_crash import NODE, NS, Node, _setup, imex_processes
from tests.integration.test_node_support import short_tmpdir

GPU_DRIVER = "gpu.nvidia.com"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _live(port: int) -> bool:
    request = health_pb2.HealthCheckRequest(service="liveness")
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=10)
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _cdi_device(cdi_root: pathlib.Path, cdi_id: str) -> dict:
    """The device a CDI id names, read from the spec files as the container runtime resolves it."""
    kind, name = cdi_id.split("=", 1)
    for path in cdi_root.iterdir():
        spec = yaml.safe_load(path.read_text())  # YAML or JSON, as CDI allows
        if spec.get("kind") == kind:
            for device in spec.get("devices") or ():
                if device["name"] == name:
                    return dict(device)
    raise AssertionError(f"no CDI spec under {cdi_root} has {cdi_id}")


def test_the_gpu_driver_off_serves_only_compute_domains() -> None:
    """Tried: the agent with --no-gpus on a node whose four GPUs are in one NVL72 clique, a channel claim of a
    one-node domain prepared and unprepared through the kubelet stand-in, then the fabric broken and mended. Only
    the compute-domain slice is published and only its plugin registers; the pod's CDI device is the channel
    node; the domain's daemon runs and goes; the channels follow the fabric; the Node is left as it was."""
    with short_tmpdir("cdalone-") as root, fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        ref = _setup(rest, "Single")
        body = rest.get(NODES, None, NODE)
        body["metadata"]["labels"] = {"nvidia.com/mig.config": "all-disabled"}  # what the GPU driver would act on
        labels_before = rest.replace(NODES, body)["metadata"]["labels"]
        port = _free_port()
        node = Node(
            root,
            server.write_kubeconfig(root / "kubeconfig"),
            "--no-gpus",
            "--healthcheck-addr",
            f"127.0.0.1:{port}",
            "--mig-reconfigure",  # on, as the DaemonSet has it: with the GPU driver off it must not act
            "--resync-interval",
            "0.5",
        )
        slice_name = f"{NODE}-{DRIVER}"

        def slices() -> dict[str, str]:
            return {s["metadata"]["name"]: s["spec"]["driver"] for s in rest.list(RESOURCE_SLICES)["items"]}

        try:
            with FakeKubelet(node.agent.kubelet_root, timeout=30) as kubelet:
                node.start()
                kubelet.wait_for_driver(DRIVER, timeout=30)
                wait_for(lambda: slice_name in slices(), timeout=30, what="the channels to be published")
                assert slices() == {slice_name: DRIVER}
                registered = sorted(p.name for p in (node.agent.kubelet_root / "plugins_registry").iterdir())
                assert registered == [f"{DRIVER}-reg.sock"]
                assert kubelet.scan() == [] and not (node.agent.kubelet_root / "plugins" / GPU_DRIVER).exists()
                assert _live(port)  # the DaemonSet's liveness probe, served by the only plugin there is

                result = kubelet.prepare(DRIVER, [ref])[ref.uid]
                assert result.error == ""
                (device,) = result.devices
                (cdi_id,) = device.cdi_device_ids
                edits = _cdi_device(node.agent.cdi_root, cdi_id)["containerEdits"]
                assert [n["path"] for n in edits["deviceNodes"]] == [channel_path(0)]
                assert node.channel_nodes() == ["channel0"]
                assert len(imex_processes(root)) == 1
                domain = rest.get(COMPUTE_DOMAINS, NS, "job")
                assert [n["name"] for n in domain["status"]["nodes"]] == [NODE]

                assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
                assert node.channel_nodes() == [] and node.specs() == []
                wait_for(lambda: imex_processes(root) == [], timeout=30, what="the daemon to stop")

                fake = FakeNvml(nvl72_node(0), root / "gpus.json")
                fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
                wait_for(lambda: slice_name not in slices(), timeout=30, what="the channels to be withdrawn")
                fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_COMPLETED)
                wait_for(lambda: slices() == {slice_name: DRIVER}, timeout=30, what="the channels to come back")
            assert node.agent.terminate() == 0
        finally:
            node.agent.close()
        assert rest.get(NODES, None, NODE)["metadata"].get("labels") == labels_before
        assert slices() == {slice_name: DRIVER}  # owned by the Node: stays for the next start
        assert not [r for r in node.agent.logs() if r.get("driver") == GPU_DRIVER]
