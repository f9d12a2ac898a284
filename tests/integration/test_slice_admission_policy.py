"""The ValidatingAdmissionPolicy of daemonset/base on upstream's kube-apiserver: the node agent's service
account writes only its own node's ResourceSlices, and a token of that account that names no node (one not
bound to a pod) is refused with the policy's own message, not a CEL evaluation error.

Real control plane only: the API server fake does not evaluate admission policies or mint tokens."""

from __future__ import annotations

import contextlib
import json
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.controlplane

BASE = Path(__file__).resolve().parents[2] / "daemonset" / "base"
NAMESPACE = "gpu-dra-agent"
ACCOUNT = "gpu-dra-agent-node"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
OWN_NODE_ONLY = "may only write ResourceSlices of its own node"
NAMES_NO_NODE = "the node agent's token names no node; it must be a pod-bound service account token"


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((BASE / name).read_text()) if d]


def send(
    cp: ControlPlane,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    token: str | None = None,
) -> tuple[int, Any]:
    """One request as the admin (impersonating through `headers`), or as the bearer of `token` alone (no
    client certificate: the token is who we are). Returns the status and the decoded answer."""
    assert cp.pki is not None
    data = None if body is None else json.dumps(body).encode()
    content = "application/merge-patch+json" if method == "PATCH" else "application/json"
    all_headers = {"Content-Type": content, "Accept": "application/json", **(headers or {})}
    if token is None:
        context = cp.ssl_context()
    else:
        all_headers["Authorization"] = f"Bearer {token}"
        context = ssl.create_default_context(cafile=str(cp.pki.ca_cert))
    request = urllib.request.Request(cp.url + path, data=data, method=method, headers=all_headers)
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"null")
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"null")


def a_slice(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The namespace, the service account with its RBAC and the admission policy, as `kubectl apply -k` puts
    them; two nodes and a slice of each. Every write the tests make is a dry run."""
    cp = control_plane
    created: list[str] = []
    for doc in documents("00-namespace.yaml") + documents("rbac.yaml") + documents("admission-policy.yaml"):
        path = _collection(doc)
        cp.request("POST", path, doc)
        created.append(f"{path}/{doc['metadata']['name']}")
    for node in ("node-a", "node-b"):
        cp.add_node(node)
        cp.request("POST", SLICES, a_slice(f"{node}-gpus", node))
    _wait_for_policy(cp)
    try:
        yield cp
    finally:
        for path in reversed(created):
            if f"/namespaces/{NAMESPACE}/" not in path:  # the namespace's own objects go with it
                cp.request("DELETE", path)
        _wait_gone(cp, f"/api/v1/namespaces/{NAMESPACE}")
        for node in ("node-a", "node-b"):
            cp.request("DELETE", f"{SLICES}/{node}-gpus")
            cp.request("DELETE", f"/api/v1/nodes/{node}")


def _wait_gone(cp: ControlPlane, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while send(cp, "GET", path)[0] != 404:
        assert time.monotonic() < deadline, f"{path} still there {timeout:.0f}s after its deletion"
        time.sleep(0.1)


def _collection(doc: dict[str, Any]) -> str:
    group_version = doc["apiVersion"]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    plural = {
        "Namespace": "namespaces",
        "ServiceAccount": "serviceaccounts",
        "ClusterRole": "clusterroles",
        "ClusterRoleBinding": "clusterrolebindings",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ValidatingAdmissionPolicy": "validatingadmissionpolicies",
        "ValidatingAdmissionPolicyBinding": "validatingadmissionpolicybindings",
    }[doc["kind"]]
    namespace = doc["metadata"].get("namespace")
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def _wait_for_policy(cp: ControlPlane, timeout: float = 30.0) -> None:
    """Policies take effect asynchronously: wait until another node's slice write is refused."""
    deadline = time.monotonic() + timeout
    while True:
        status, _ = send(cp, "DELETE", f"{SLICES}/node-b-gpus?dryRun=All", headers=impersonating("node-a"))
        if status == 403:
            return
        assert time.monotonic() < deadline, f"the admission policy is not in force after {timeout:.0f}s ({status})"
        time.sleep(0.2)


def impersonating(node: str | None) -> dict[str, str]:
    headers = {"Impersonate-User": f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"}
    if node is not None:
        headers["Impersonate-Extra-" + NODE_NAME_EXTRA.replace("/", "%2F")] = node
    return headers


def token(cp: ControlPlane, pod: str | None = None) -> str:
    """A token of the agent's service account: bound to `pod` (its node named in the token), or not bound."""
    spec: dict[str, Any] = {"expirationSeconds": 600}
    if pod is not None:
        uid = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}")["metadata"]["uid"]
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod, "uid": uid}
    review = cp.request(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{ACCOUNT}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return str(review["status"]["token"])


@contextlib.contextmanager
def agent_on_node_a(cp: ControlPlane) -> Iterator[str]:
    """A pod of the node agent's account on node-a, and a token bound to it (the pod deleted after)."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent", "namespace": NAMESPACE},
        "spec": {
            "serviceAccountName": ACCOUNT,
            "nodeName": "node-a",
            "containers": [{"name": "agent", "image": "gpu-dra-agent:test"}],
        },
    }
    cp.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
    try:
        yield token(cp, "agent")
    finally:
        cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/agent?gracePeriodSeconds=0")


def writes(node: str) -> list[tuple[str, str, Any]]:
    """Create, update, patch and delete of a slice of `node` (dry run: nothing is stored)."""
    name = f"{node}-gpus"
    return [
        ("POST", f"{SLICES}?dryRun=All", a_slice(f"{node}-more", node)),
        ("PUT", f"{SLICES}/{name}?dryRun=All", None),  # body filled in from the stored object
        ("PATCH", f"{SLICES}/{name}?dryRun=All", {"metadata": {"labels": {"touched": "yes"}}}),
        ("DELETE", f"{SLICES}/{name}?dryRun=All", None),
    ]


def attempt(cp: ControlPlane, node: str, **who: Any) -> list[tuple[str, int, str]]:
    out = []
    for method, path, body in writes(node):
        stored = cp.request("GET", f"{SLICES}/{node}-gpus") if method == "PUT" else body
        status, answer = send(cp, method, path, stored, **who)
        out.append((method, status, str((answer or {}).get("message", ""))))
    return out


def test_a_token_without_a_node_name_gets_the_policys_own_message(installed: ControlPlane) -> None:
    """Neither an unbound token of the agent's account nor an impersonation without the node-name extra may
    write any slice; each is a 403 Forbidden naming the policy's reason, never a CEL 'no such key' error."""
    cp = installed
    for who in ({"token": token(cp)}, {"headers": impersonating(None)}):
        for method, status, message in attempt(cp, "node-a", **who):
            assert (method, status) == (method, 403), message
            assert NAMES_NO_NODE in message, message
            assert "no such key" not in message and "expression" not in message, message


def test_the_agent_writes_its_own_nodes_slices_and_no_others(installed: ControlPlane) -> None:
    cp = installed
    with agent_on_node_a(cp) as bound:
        for who in ({"token": bound}, {"headers": impersonating("node-a")}):
            assert [(m, s) for m, s, _ in attempt(cp, "node-a", **who)] == [
                ("POST", 201),
                ("PUT", 200),
                ("PATCH", 200),
                ("DELETE", 200),
            ]
            for method, status, message in attempt(cp, "node-b", **who):
                assert status == 403, (method, message)
                assert f"the node agent on node node-a {OWN_NODE_ONLY}" in message, message
