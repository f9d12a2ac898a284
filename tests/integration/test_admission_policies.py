"""Mutating and validating admission policies applied on create and update, by the fake as by kube-apiserver
1.37 (MutatingAdmissionPolicy GA since 1.36): the arbiter overlay's gate, an ApplyConfiguration, a Deny."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fakes.apiserver.admission import untyped
from tests.integration.conftest import Cluster

KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
GATE_POLICY = Path(__file__).resolve().parents[2] / "daemonset" / "overlays" / "arbiter" / "admission-gate.yaml"
CLAIM_POLICY = GATE_POLICY.with_name("claim-protection.yaml")
GATE = "scheduling.gpu-dra-agent.io/arbiter"
PROTECTION = "resource.kubernetes.io/delete-protection"
QUEUE_LABEL = "scheduling.gpu-dra-agent.io/queue"


def _pod(labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "p-", "namespace": "default", "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


def _until(create: Any, accept: Any, timeout: float = 20.0) -> Any:
    """A real kube-apiserver applies a new policy once its informer has it: retry until it does."""
    deadline = time.monotonic() + timeout
    while True:
        created = create()
        if accept(created) or time.monotonic() > deadline:
            return created
        time.sleep(0.3)


def needs_mutating_policies(cluster: Cluster) -> None:
    listed = cluster.raw("GET", "/apis/admissionregistration.k8s.io/v1").body
    if not any(r.get("name") == "mutatingadmissionpolicies" for r in listed.get("resources") or []):
        pytest.skip("MutatingAdmissionPolicy v1 is served from Kubernetes 1.36")


def _gates(pod: dict[str, Any]) -> list[str]:
    return [g["name"] for g in pod["spec"].get("schedulingGates") or []]


def _claim(*requests: dict[str, Any], finalizers: list[str] | None = None) -> dict[str, Any]:
    metadata: dict[str, Any] = {"generateName": "c-", "namespace": "default"}
    if finalizers:
        metadata["finalizers"] = finalizers
    spec = {"devices": {"requests": list(requests)}}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": metadata, "spec": spec}


def _apply(cluster: Cluster, tmp_path: Path, manifest: Path) -> None:
    assert KUBECTL is not None
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    applied = subprocess.run(
        [KUBECTL, f"--kubeconfig={config}", "apply", "-f", str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert applied.returncode == 0, applied.stderr


@needs_kubectl
def test_the_arbiter_overlays_policy_protects_new_claims_of_the_drivers_classes(
    cluster: Cluster, tmp_path: Path
) -> None:
    # the finalizer its allocator would add with a write of its own just before allocating is there from creation
    needs_mutating_policies(cluster)
    _apply(cluster, tmp_path, CLAIM_POLICY)

    claims = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
    created: list[str] = []

    def create(claim: dict[str, Any]) -> dict[str, Any]:
        answer = cluster.raw("POST", claims, claim)
        assert answer.status == 201, answer
        created.append(answer.body["metadata"]["name"])
        return answer.body  # type: ignore[no-any-return]

    try:
        _protected_claims(create)
    finally:  # example.com/keep has no controller to remove it (the fake has none for either finalizer)
        for name in created:
            cluster.raw("PATCH", f"{claims}/{name}", {"metadata": {"finalizers": None}})


def _protected_claims(create: Any) -> None:
    gpu = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    first = _until(lambda: create(_claim(gpu)), lambda c: PROTECTION in (c["metadata"].get("finalizers") or []))
    assert first["metadata"]["finalizers"] == [PROTECTION]
    # a firstAvailable request any of whose choices is a MIG device, beside a request of another driver's
    either = {
        "name": "either",
        "firstAvailable": [
            {"name": "nic", "deviceClassName": "nic.example.com"},
            {"name": "mig", "deviceClassName": "mig.nvidia.com"},
        ],
    }
    nic = {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}}
    assert create(_claim(nic, either))["metadata"]["finalizers"] == [PROTECTION]
    # another driver's claim is left as it was; a claim that has finalizers keeps them and gets this one once
    assert "finalizers" not in create(_claim(nic))["metadata"]
    kept = create(_claim(gpu, finalizers=["example.com/keep"]))["metadata"]["finalizers"]
    assert kept == ["example.com/keep", PROTECTION]
    assert create(_claim(gpu, finalizers=[PROTECTION]))["metadata"]["finalizers"] == [PROTECTION]


@needs_kubectl
def test_the_arbiter_overlays_policy_gates_queue_pods(cluster: Cluster, tmp_path: Path) -> None:
    needs_mutating_policies(cluster)
    _apply(cluster, tmp_path, GATE_POLICY)

    def create() -> dict[str, Any]:
        answer = cluster.raw("POST", "/api/v1/namespaces/default/pods", _pod({QUEUE_LABEL: "team-a"}))
        assert answer.status == 201, answer
        return answer.body  # type: ignore[no-any-return]

    gated = _until(create, lambda p: GATE in _gates(p))
    assert _gates(gated) == [GATE]
    plain = cluster.raw("POST", "/api/v1/namespaces/default/pods", _pod({"app": "x"})).body
    assert _gates(plain) == []
    # A pod that has other gates keeps them and gets the arbiter's once.
    with_gate = _pod({QUEUE_LABEL: "team-a"})
    with_gate["spec"]["schedulingGates"] = [{"name": "example.com/other"}]
    both = cluster.raw("POST", "/api/v1/namespaces/default/pods", with_gate).body
    assert _gates(both) == ["example.com/other", GATE]


def _policy(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "admissionregistration.k8s.io/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}


def test_apply_configuration_and_deny_on_create_and_update(cluster: Cluster) -> None:
    needs_mutating_policies(cluster)
    base = "/apis/admissionregistration.k8s.io/v1"
    rules = {
        "resourceRules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["configmaps"]}
        ]
    }
    for path, body in (
        (
            "mutatingadmissionpolicies",
            _policy(
                "MutatingAdmissionPolicy",
                "stamp",
                {
                    "matchConstraints": rules,
                    "failurePolicy": "Fail",
                    "reinvocationPolicy": "Never",
                    "matchConditions": [
                        {
                            "name": "team",
                            "expression": "has(object.metadata.labels) && 'team' in object.metadata.labels",
                        }
                    ],
                    "mutations": [
                        {
                            "patchType": "ApplyConfiguration",
                            "applyConfiguration": {
                                "expression": (
                                    'Object{metadata: Object.metadata{labels: {"stamped": '
                                    '"by-" + object.metadata.labels["team"]}}}'
                                )
                            },
                        }
                    ],
                },
            ),
        ),
        (
            "mutatingadmissionpolicybindings",
            _policy("MutatingAdmissionPolicyBinding", "stamp", {"policyName": "stamp"}),
        ),
        (
            "validatingadmissionpolicies",
            _policy(
                "ValidatingAdmissionPolicy",
                "no-secrets-in-configmaps",
                {
                    "matchConstraints": rules,
                    "failurePolicy": "Fail",
                    "validations": [
                        {
                            "expression": "!has(object.data) || !('password' in object.data)",
                            "messageExpression": "'configmap ' + object.metadata.name + ' holds a password'",
                            "reason": "Forbidden",
                        }
                    ],
                },
            ),
        ),
        (
            "validatingadmissionpolicybindings",
            _policy(
                "ValidatingAdmissionPolicyBinding",
                "no-secrets-in-configmaps",
                {"policyName": "no-secrets-in-configmaps", "validationActions": ["Deny"]},
            ),
        ),
    ):
        answer = cluster.raw("POST", f"{base}/{path}", body)
        assert answer.status == 201, answer

    def create() -> Any:
        name = f"c{time.monotonic_ns()}"
        return cluster.raw(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name, "labels": {"team": "a"}},
                "data": {"password": "x"},
            },
        )

    denied = _until(create, lambda a: a.status == 403)
    assert denied.status == 403, denied
    assert "holds a password" in denied.body["message"]
    stamped = _until(
        lambda: cluster.raw(
            "POST",
            "/api/v1/namespaces/default/configmaps",
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"generateName": "ok-", "labels": {"team": "a"}},
                "data": {"k": "v"},
            },
        ),
        lambda a: (a.body.get("metadata", {}).get("labels") or {}).get("stamped"),
    )
    assert stamped.status == 201, stamped
    assert stamped.body["metadata"]["labels"] == {"team": "a", "stamped": "by-a"}
    name = stamped.body["metadata"]["name"]
    updated = {**stamped.body, "data": {"password": "y"}}
    refused = cluster.raw("PUT", f"/api/v1/namespaces/default/configmaps/{name}", updated)
    assert refused.status == 403, refused  # on update too
    kept = cluster.raw("GET", f"/api/v1/namespaces/default/configmaps/{name}").body
    assert kept["data"] == {"k": "v"}


def test_typed_cel_literals_become_maps_outside_strings() -> None:
    assert untyped('Object.spec.schedulingGates{name: "a{b: c}"}') == '{"name": "a{b: c}"}'
    assert (
        untyped('[JSONPatch{op: "add", path: "/x", value: {"k": 1}}]')
        == '[{"op": "add", "path": "/x", "value": {"k": 1}}]'
    )
    assert untyped("{'a': 1}") == "{'a': 1}"


@pytest.mark.parametrize(("version", "warns"), [("1.35", True), ("1.37", False)])
def test_the_arbiter_warns_when_the_gate_policy_cannot_apply(
    version: str, warns: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import fakes.apiserver
    from agent.commands.arbiter import warn_without_gate_policy

    with fakes.apiserver.start(kubernetes_version=version) as server:
        assert warn_without_gate_policy(server.rest()) is warns
    said = [r.getMessage() for r in caplog.records if "MutatingAdmissionPolicy" in r.getMessage()]
    assert len(said) == (1 if warns else 0)
    if warns:
        assert "scheduling.gpu-dra-agent.io/arbiter" in said[0] and "--feature-gates" in said[0]
