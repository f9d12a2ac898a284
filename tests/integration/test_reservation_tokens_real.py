"""Issue 33 item 9 on upstream's kube-apiserver: the node agent, with the RBAC the manifests give it, checks the
arbiter's service-account token through TokenReview (audience gpu-dra-agent-reservations), and refuses every
other token. Tokens come from the TokenRequest API, as kubelet projects them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.kube.rest import Rest
from agent.names import ARBITER_USER, RESERVATION_AUDIENCE
from agent.reservation.auth import TokenReviewer
from agent.reservation.protocol import NodeUnavailable, Unauthenticated
from tests.controlplane.cluster import ControlPlane

pytestmark = pytest.mark.controlplane

DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"
NAMESPACE = "gpu-dra-agent"
NODE_ACCOUNT = "gpu-dra-agent-node"
ARBITER_ACCOUNT = ARBITER_USER.split(":")[3]
PLURALS = {
    "Namespace": "namespaces",
    "ServiceAccount": "serviceaccounts",
    "ClusterRole": "clusterroles",
    "ClusterRoleBinding": "clusterrolebindings",
    "Role": "roles",
    "RoleBinding": "rolebindings",
}


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d and d["kind"] in PLURALS]


def collection(doc: dict[str, Any]) -> str:
    group_version = doc["apiVersion"]
    prefix = "/api/v1" if group_version == "v1" else f"/apis/{group_version}"
    namespace = doc["metadata"].get("namespace")
    plural = PLURALS[doc["kind"]]
    return f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"


def token(cp: ControlPlane, account: str, audiences: list[str] | None = None) -> str:
    spec: dict[str, Any] = {"expirationSeconds": 600}
    if audiences is not None:
        spec["audiences"] = audiences
    answer = cp.request(
        "POST",
        f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts/{account}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
    )
    return str(answer["status"]["token"])


def rest_as(cp: ControlPlane, tmp: Path, account: str) -> Rest:
    """The API as that service account (its token, no client certificate), as the agent runs in its pod."""
    from agent.kube.kubeconfig import connect

    config = cp.kubeconfig()
    config["users"] = [{"name": account, "user": {"token": token(cp, account)}}]
    config["contexts"][0]["context"]["user"] = account
    path = tmp / f"{account}.kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return connect(str(path))


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The namespace, both service accounts and their RBAC, from daemonset/ as `kubectl apply -k` puts them."""
    cp = control_plane
    created: list[str] = []
    docs = (
        documents(DAEMONSET / "base" / "00-namespace.yaml")
        + documents(DAEMONSET / "base" / "rbac.yaml")
        + documents(DAEMONSET / "overlays" / "arbiter" / "arbiter.yaml")
    )
    for doc in docs:
        path = collection(doc)
        cp.request("POST", path, doc)
        created.append(f"{path}/{doc['metadata']['name']}")
    try:
        yield cp
    finally:
        for path in reversed(created):
            if f"/namespaces/{NAMESPACE}/" not in path:  # the namespace's own objects go with it
                cp.request("DELETE", path)


def test_the_node_agent_accepts_the_arbiters_token_and_refuses_others(installed: ControlPlane, tmp_path: Path) -> None:
    cp = installed
    reviewer = TokenReviewer(rest_as(cp, tmp_path, NODE_ACCOUNT))  # the RBAC of the manifests, no more
    reviewer.authenticate(token(cp, ARBITER_ACCOUNT, [RESERVATION_AUDIENCE]))
    assert reviewer.reviews == 1
    # a rotated token (kubelet asks for a new one well before the old one expires) is accepted as well
    reviewer.authenticate(token(cp, ARBITER_ACCOUNT, [RESERVATION_AUDIENCE]))
    refused = {
        "the node agent's own token for the audience": (
            token(cp, NODE_ACCOUNT, [RESERVATION_AUDIENCE]),
            f"system:serviceaccount:{NAMESPACE}:{NODE_ACCOUNT} may not reserve devices here: only {ARBITER_USER}",
        ),
        "the arbiter's token for the API server's audience": (
            token(cp, ARBITER_ACCOUNT),
            "the API server does not accept the token: .*audience",
        ),
        "a string that is no token": ("s3cret-token", "the API server does not accept the token"),
    }
    for what, (bearer, why) in refused.items():
        with pytest.raises(Unauthenticated, match=why):
            reviewer.authenticate(bearer)
        assert what


def test_without_the_tokenreviews_grant_the_node_cannot_check_and_says_so(
    installed: ControlPlane, tmp_path: Path
) -> None:
    """The arbiter's own account may not create TokenReviews: as a node agent missing its grant would be."""
    cp = installed
    reviewer = TokenReviewer(rest_as(cp, tmp_path, ARBITER_ACCOUNT))
    with pytest.raises(NodeUnavailable, match="TokenReview failed"):
        reviewer.authenticate(token(cp, ARBITER_ACCOUNT, [RESERVATION_AUDIENCE]))
