"""Our protos against the verbatim upstream ones: same wire, and generated code in step with the sources."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from agent._proto.kubelet import (
    dra_health_v1_pb2,
    dra_health_v1alpha1_pb2,
    dra_v1_pb2,
    dra_v1beta1_pb2,
    pluginregistration_v1_pb2,
)
from tests.fixtures.upstream_protos.client import DRA, HEALTH, HEALTH_V1, REGISTRATION, UpstreamKubelet

REPO = Path(__file__).resolve().parents[2]
PAIRS = [
    (dra_v1_pb2, DRA["v1"]),
    (dra_v1beta1_pb2, DRA["v1beta1"]),
    (pluginregistration_v1_pb2, REGISTRATION),
    (dra_health_v1alpha1_pb2, HEALTH),
    (dra_health_v1_pb2, HEALTH_V1),
]


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    return UpstreamKubelet(tmp_path_factory.mktemp("upstream"))


def wire(file: descriptor_pb2.FileDescriptorProto) -> dict:
    """Everything that decides the bytes on the wire and the gRPC paths; names, numbers, types, streaming."""

    def fields(message):
        return {f.name: (f.number, f.label, f.type, f.type_name) for f in message.field}

    def messages(items, prefix):
        out = {}
        for m in items:
            out[f"{prefix}.{m.name}"] = (fields(m), m.options.map_entry)
            out.update(messages(m.nested_type, f"{prefix}.{m.name}"))
        return out

    return {
        "package": file.package,
        "messages": messages(file.message_type, file.package),
        "enums": {e.name: [(v.name, v.number) for v in e.value] for e in file.enum_type},
        "methods": {
            f"/{file.package}.{s.name}/{m.name}": (m.input_type, m.output_type, m.client_streaming, m.server_streaming)
            for s in file.service
            for m in s.method
        },
    }


@pytest.mark.parametrize(("ours", "theirs"), PAIRS, ids=[p[1].split("apis/")[1] for p in PAIRS])
def test_our_protos_are_wire_identical_to_upstream(upstream, ours, theirs):
    mine = descriptor_pb2.FileDescriptorProto()
    ours.DESCRIPTOR.CopyToProto(mine)
    upstream_file = next(f for f in upstream.files.file if f.name == theirs)
    assert wire(mine) == wire(upstream_file)


def test_full_method_names_are_the_kubelets():
    methods = {
        f"/{m.containing_service.full_name}/{m.name}"
        for module in (
            dra_v1_pb2,
            dra_v1beta1_pb2,
            pluginregistration_v1_pb2,
            dra_health_v1alpha1_pb2,
            dra_health_v1_pb2,
        )
        for s in module.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    }
    assert methods == {
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        "/pluginregistration.Registration/GetInfo",
        "/pluginregistration.Registration/NotifyRegistrationStatus",
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
        "/v1.DRAResourceHealth/NodeWatchResources",
    }


def test_bytes_we_write_parse_with_upstream_messages(upstream):
    ours = dra_v1_pb2.NodePrepareResourcesResponse()
    entry = ours.claims["uid-a"]
    entry.devices.add(
        request_names=["gpu"],
        pool_name="node-a",
        device_name="gpu-0",
        cdi_device_ids=["k8s.gpu.nvidia.com/claim=uid-a-gpu-0"],
    )
    ours.claims["uid-b"].error = "device is unhealthy"
    theirs = upstream.message("k8s.io.kubelet.pkg.apis.dra.v1.NodePrepareResourcesResponse").FromString(
        ours.SerializeToString()
    )
    device = theirs.claims["uid-a"].devices[0]
    assert list(device.cdi_device_ids) == ["k8s.gpu.nvidia.com/claim=uid-a-gpu-0"]
    assert (device.pool_name, device.device_name) == ("node-a", "gpu-0")
    assert theirs.claims["uid-b"].error == "device is unhealthy"


def test_generated_code_is_up_to_date():
    command = [sys.executable, "proto/generate.py", "--check"]
    run = subprocess.run(command, check=False, cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, f"agent/_proto is stale, run `make proto`:\n{run.stdout}{run.stderr}"


def test_the_staleness_check_notices_a_changed_file(tmp_path):
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    fresh = generate.generate(tmp_path / "a")
    copy = generate.generate(tmp_path / "b")
    assert generate.differences(fresh, copy) == []
    edited = copy / "kubelet" / "dra_v1_pb2.py"
    edited.write_text(edited.read_text() + "# hand edit\n")
    (copy / "kubelet" / "dra_v1_pb2.pyi").unlink()
    assert generate.differences(fresh, copy) == ["kubelet/dra_v1_pb2.py", "kubelet/dra_v1_pb2.pyi"]
