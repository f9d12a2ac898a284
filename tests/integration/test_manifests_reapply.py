"""`kubectl apply -k` of the install a second time changes nothing, and says so: every object "unchanged", on the
fake and on kube-apiserver 1.37. Tried before: the admission policies were "configured" on every re-apply, as
kube-apiserver fills in each resource rule's `scope: "*"`, and kubectl then sends the atomic rule list again."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import Cluster, kubectl, needs_kubectl

pytestmark = needs_kubectl
DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"


@pytest.mark.parametrize("install", ["daemonset", "daemonset/overlays/arbiter"])
def test_a_second_apply_leaves_every_object_unchanged(cluster: Cluster, tmp_path: Path, install: str) -> None:
    listed = cluster.raw("GET", "/apis/admissionregistration.k8s.io/v1").body
    if install.endswith("arbiter") and not any(
        r.get("name") == "mutatingadmissionpolicies" for r in listed.get("resources") or []
    ):
        pytest.skip("the arbiter overlay's MutatingAdmissionPolicy v1 is served from Kubernetes 1.36")
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    directory = str(DAEMONSET.parent / install)
    try:
        first = kubectl(config, "apply", "-k", directory)
        assert first.returncode == 0, first.stderr
        again = kubectl(config, "apply", "-k", directory)
        assert again.returncode == 0, again.stderr
        lines = again.stdout.strip().splitlines()
        assert lines and all(line.endswith(" unchanged") for line in lines), again.stdout
        assert any("validatingadmissionpolicy" in line for line in lines)
    finally:  # the real control plane is shared: policies, fence and roles must not reach the next test
        kubectl(config, "delete", "-k", directory, "--ignore-not-found", "--wait=false")
