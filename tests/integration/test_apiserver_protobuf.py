"""application/vnd.kubernetes.protobuf: kubectl's typed `create` commands against the fake and the real
kube-apiserver, and the fake's protobuf codec (upstream's generated.proto) checked against the real server's
own bytes in both directions."""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest

from fakes.apiserver import protobuf
from tests.integration.conftest import Cluster

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
PROTOBUF = {"Accept": f"{protobuf.MEDIA_TYPE}, application/json"}


def kubectl(kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert KUBECTL is not None
    return subprocess.run(
        [KUBECTL, f"--kubeconfig={kubeconfig}", *args], capture_output=True, text=True, timeout=60, check=False
    )


@needs_kubectl
def test_the_readmes_kubectl_create_commands_work(cluster: Cluster, tmp_path: Path) -> None:
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    steps = [
        ("create", "namespace", "gpu-dra-agent"),
        (
            "-n",
            "gpu-dra-agent",
            "create",
            "secret",
            "generic",
            "gpu-dra-agent-reservation-token",
            "--from-literal=token=0123abcd",
        ),
        ("-n", "gpu-dra-agent", "create", "configmap", "settings", "--from-literal=period=2"),
    ]
    for args in steps:
        done = kubectl(config, *args)
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        assert "created" in done.stdout
    secret = cluster.raw("GET", "/api/v1/namespaces/gpu-dra-agent/secrets/gpu-dra-agent-reservation-token").body
    assert base64.b64decode(secret["data"]["token"]) == b"0123abcd"
    configmap = cluster.raw("GET", "/api/v1/namespaces/gpu-dra-agent/configmaps/settings").body
    assert configmap["data"] == {"period": "2"}
    assert cluster.raw("GET", "/api/v1/namespaces/gpu-dra-agent").status == 200


def _create_pod(cluster: Cluster) -> dict[str, object]:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "labels": {"app": "x"}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "busybox",
                    "command": ["sleep", "1"],
                    "resources": {"limits": {"cpu": "500m", "memory": "64Mi"}},
                    "ports": [{"containerPort": 8080, "name": "http"}],
                    "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 3},
                    "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                }
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "terminationGracePeriodSeconds": 0,
        },
    }
    answer = cluster.raw("POST", "/api/v1/namespaces/default/pods", pod)
    assert answer.status == 201, answer
    return answer.body  # type: ignore[no-any-return]


def test_protobuf_answers_decode_to_the_json_answer(cluster: Cluster) -> None:
    """The server's protobuf bytes for an object, decoded by the fake's codec, are its JSON answer: on the real
    kube-apiserver this checks the codec; on the fake it checks the fake answers protobuf when asked."""
    _create_pod(cluster)
    path = "/api/v1/namespaces/default/pods/p"
    for _ in range(10):  # a real scheduler may update the pod between the two reads: compare one version
        as_json = cluster.raw("GET", path).body
        as_protobuf = cluster.raw("GET", path, headers=PROTOBUF)
        assert as_protobuf.status == 200
        assert as_protobuf.data.startswith(protobuf.MAGIC)
        decoded = protobuf.decode(as_protobuf.data)
        if decoded["metadata"]["resourceVersion"] == as_json["metadata"]["resourceVersion"]:
            break
    assert decoded == as_json
    listed = protobuf.decode(cluster.raw("GET", "/api/v1/namespaces/default/pods", headers=PROTOBUF).data)
    assert listed["kind"] == "PodList"
    assert [item["metadata"]["name"] for item in listed["items"]] == ["p"]


def test_the_codecs_bytes_are_accepted_as_written(cluster: Cluster) -> None:
    """A Pod and a ResourceClaim encoded by the fake's codec are stored by the server as their JSON says."""
    env = [{"name": "A", "valueFrom": {"configMapKeyRef": {"name": "m", "key": "k"}}}]
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "q", "namespace": "default"},
        "spec": {
            "containers": [{"name": "c", "image": "busybox", "env": env}],
            "volumes": [{"name": "v", "configMap": {"name": "m", "defaultMode": 0o644}}],
        },
    }
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}}],
                "config": [
                    {
                        "requests": ["gpu"],
                        "opaque": {
                            "driver": "gpu.nvidia.com",
                            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"},
                        },
                    }
                ],
            }
        },
    }
    for path, obj in (
        ("/api/v1/namespaces/default/pods", pod),
        ("/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", claim),
    ):
        headers = {"Content-Type": protobuf.MEDIA_TYPE, **PROTOBUF}
        answer = cluster.raw("POST", path, protobuf.encode(obj), headers=headers)
        assert answer.status == 201, protobuf.decode(answer.data) if answer.data.startswith(protobuf.MAGIC) else answer
        stored = cluster.raw("GET", f"{path}/{obj['metadata']['name']}").body  # type: ignore[index]
        created = protobuf.decode(answer.data)
        assert created["spec"] == stored["spec"]  # status moves on (a real scheduler marks pods unschedulable)
        assert created["metadata"]["uid"] == stored["metadata"]["uid"]
        assert stored["spec"]["volumes" if obj is pod else "devices"]
    stored_pod = cluster.raw("GET", "/api/v1/namespaces/default/pods/q").body
    assert stored_pod["spec"]["volumes"][0]["configMap"] == {"name": "m", "defaultMode": 0o644}
    assert stored_pod["spec"]["containers"][0]["env"][0]["valueFrom"] == {"configMapKeyRef": {"name": "m", "key": "k"}}
    stored_claim = cluster.raw("GET", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/c").body
    assert stored_claim["spec"]["devices"]["config"][0]["opaque"]["parameters"]["kind"] == "GpuConfig"


def test_errors_come_back_as_a_protobuf_status_when_asked(cluster: Cluster) -> None:
    answer = cluster.raw("GET", "/api/v1/namespaces/default/secrets/missing", headers=PROTOBUF)
    assert answer.status == 404
    status = protobuf.decode(answer.data)
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "NotFound", 404)


def test_a_body_that_is_not_an_envelope_is_refused_clearly(cluster: Cluster) -> None:
    headers = {"Content-Type": protobuf.MEDIA_TYPE}
    answer = cluster.raw("POST", "/api/v1/namespaces/default/configmaps", b"\x0a\x03abc", headers=headers)
    assert answer.status in (400, 415), answer
    stored = cluster.raw("GET", "/api/v1/namespaces/default/configmaps").body["items"]
    # nothing was stored; the real control plane publishes its CA in every namespace (kube-root-ca.crt)
    assert [c["metadata"]["name"] for c in stored if c["metadata"]["name"] != "kube-root-ca.crt"] == []
