"""The real control plane the `controlplane` tier runs on: what it serves, how it is reached, how it stops."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from kubernetes import client

from tests.controlplane import build
from tests.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.controlplane


def test_serves_the_pinned_release_with_the_apis_the_project_uses(control_plane: ControlPlane) -> None:
    api = control_plane.api_client()
    version = client.VersionApi(api).get_code()
    assert (version.git_version, version.major, version.minor) == (build.kubernetes_version(), "1", "37")
    served = {g.name: {v.version for v in g.versions} for g in client.ApisApi(api).get_api_versions().groups}
    assert "v1" in served["resource.k8s.io"]
    assert "v1beta1" in served["scheduling.k8s.io"]  # the gang API, switched on by runtime-config + gate
    resources = {r.name for r in client.ResourceV1Api(api).get_api_resources().resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses", "devicetaintrules"} <= (
        resources
    )
    scheduling = control_plane.request("GET", "/apis/scheduling.k8s.io/v1beta1")
    assert {"podgroups", "workloads"} <= {r["name"] for r in scheduling["resources"]}


def test_admin_kubeconfig_works_for_the_client_and_rbac_is_enforced(control_plane: ControlPlane) -> None:
    core = client.CoreV1Api(control_plane.api_client())
    assert "default" in {n.metadata.name for n in core.list_namespace().items}
    # RBAC is the authorizer: a service account with no bindings may not list nodes.
    review = client.AuthorizationV1Api(control_plane.api_client()).create_subject_access_review(
        {
            "spec": {
                "user": "system:serviceaccount:default:default",
                "resourceAttributes": {"verb": "list", "resource": "nodes"},
            }
        }
    )
    assert review.status.allowed is False


def test_nodes_look_ready_and_stay_untainted(control_plane: ControlPlane) -> None:
    try:
        control_plane.add_node("harness-node")
        time.sleep(1)  # a node-lifecycle controller would taint an unheartbeated node; none runs
        node = client.CoreV1Api(control_plane.api_client()).read_node("harness-node")
        ready = [c for c in node.status.conditions if c.type == "Ready"]
        assert [c.status for c in ready] == ["True"]
        assert not node.spec.taints and not node.spec.unschedulable
        assert node.status.allocatable["pods"] == "110"
    finally:
        control_plane.request("DELETE", "/api/v1/nodes/harness-node")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not on PATH")
def test_kubectl_talks_to_it_with_the_written_kubeconfig(control_plane: ControlPlane, tmp_path: Path) -> None:
    kubeconfig = control_plane.write_kubeconfig(tmp_path / "kubeconfig")
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(kubeconfig), "get", "namespaces", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "kube-system" in {n["metadata"]["name"] for n in json.loads(out.stdout)["items"]}


def test_a_second_control_plane_starts_and_stops_cleanly(control_plane: ControlPlane) -> None:
    """Own ports and directories (so sessions side by side do not collide), and nothing left behind on stop."""
    other = ControlPlane(control_plane.binaries).start()
    workdir, processes = other.workdir, [c.process for c in other.components]
    try:
        assert other.port != control_plane.port
        assert client.VersionApi(other.api_client()).get_code().minor == "37"
    finally:
        other.stop()
    assert all(p.poll() is not None for p in processes)
    assert not workdir.exists()
