"""What a new user runs from the README, with kubectl itself, against the fake and the real control plane:
`kubectl apply -R -f daemonset/` on a fresh server, `kubectl get events` columns, `kubectl explain queues`."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import Cluster, kubectl, needs_kubectl

pytestmark = needs_kubectl
DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"


def rows(output: str) -> list[list[str]]:
    return [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()]


def test_apply_recursive_of_the_daemonset_directory_passes_on_a_fresh_server(cluster: Cluster, tmp_path: Path) -> None:
    listed = cluster.raw("GET", "/apis/admissionregistration.k8s.io/v1").body
    if not any(r.get("name") == "mutatingadmissionpolicies" for r in listed.get("resources") or []):
        pytest.skip("the arbiter overlay's MutatingAdmissionPolicy v1 is served from Kubernetes 1.36")
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    try:
        done = kubectl(config, "apply", "-R", "-f", str(DAEMONSET))
        assert done.returncode == 0, done.stderr
        assert "namespace/gpu-dra-agent created" in done.stdout
        assert "daemonset.apps/gpu-dra-agent-node created" in done.stdout
    finally:  # the real control plane is shared: its fence, gate, policies and roles must not reach the next test
        kubectl(config, "delete", "-R", "-f", str(DAEMONSET), "--ignore-not-found")


def _event(name: str, node: str, reason: str, kind: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": "default"},
        "involvedObject": {"kind": "Node", "name": node, "apiVersion": "v1"},
        "reason": reason,
        "type": kind,
        "message": message,
        "source": {"component": "gpu-dra-agent", "host": node},
        "count": 2,
        "firstTimestamp": "2026-01-01T00:00:00Z",
        "lastTimestamp": "2026-01-01T00:00:00Z",
    }


def test_get_events_shows_type_reason_object_and_message(cluster: Cluster, tmp_path: Path) -> None:
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    for event in (
        _event("gpu-7.a", "gpu-7", "MigConfigApplied", "Normal", "all-1g.10gb applied  "),
        _event("gpu-8.b", "gpu-8", "MigConfigFailed", "Warning", "unknown config x"),
    ):
        assert cluster.raw("POST", "/api/v1/namespaces/default/events", event).status == 201
    # The README's command.
    done = kubectl(config, "get", "events", "--field-selector", "involvedObject.name=gpu-7")
    assert done.returncode == 0, done.stderr
    header, *body = rows(done.stdout)
    assert header == ["LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    assert [row[1:] for row in body] == [["Normal", "MigConfigApplied", "node/gpu-7", "all-1g.10gb applied"]]
    wide = rows(kubectl(config, "get", "events", "-o", "wide", "--sort-by=.reason").stdout)
    assert wide[0] == [
        "LAST SEEN",
        "TYPE",
        "REASON",
        "OBJECT",
        "SUBOBJECT",
        "SOURCE",
        "MESSAGE",
        "FIRST SEEN",
        "COUNT",
        "NAME",
    ]
    assert [row[2:4] + row[-2:] for row in wide[1:]] == [
        ["MigConfigApplied", "node/gpu-7", "2", "gpu-7.a"],
        ["MigConfigFailed", "node/gpu-8", "2", "gpu-8.b"],
    ]
    assert "gpu-dra-agent, gpu-8" in wide[2]


def test_explain_queues_describes_every_field(cluster: Cluster, tmp_path: Path) -> None:
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    done = kubectl(config, "apply", "-f", str(DAEMONSET / "overlays" / "arbiter" / "queue-crd.yaml"))
    assert done.returncode == 0, done.stderr
    kubectl(config, "wait", "--for=condition=Established", "crd/queues.scheduling.gpu-dra-agent.io")
    deadline = time.monotonic() + 30  # kube-apiserver publishes a new CRD's discovery and OpenAPI a moment later
    while (explained := kubectl(config, "explain", "queues")).returncode != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert explained.returncode == 0, explained.stderr
    assert "A queue of the gpu-dra-agent arbiter" in explained.stdout
    document = cluster.raw("GET", "/openapi/v3/apis/scheduling.gpu-dra-agent.io/v1alpha1").body
    schema = document["components"]["schemas"]["io.gpu-dra-agent.scheduling.v1alpha1.Queue"]
    undescribed: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if "$ref" not in node and "allOf" not in node and not node.get("description"):
            undescribed.append(path or "Queue")
        for name, child in (node.get("properties") or {}).items():
            if name != "metadata":  # ObjectMeta's own
                walk(child, f"{path}.{name}")
        if isinstance(node.get("items"), dict) and node["items"].get("properties"):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    assert undescribed == []
    leaf = kubectl(config, "explain", "queues.spec.resources.gpu.quota")
    assert "guaranteed amount" in leaf.stdout
