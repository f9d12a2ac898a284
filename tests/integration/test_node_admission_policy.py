"""The Node policy of daemonset/base on upstream's kube-apiserver: the node agent's service account may patch
only its own Node, and there only the keys the agent writes (agent.migconfig's state label, agent.arbiter's
reservation address and fingerprint annotations). Tried before the policy: an agent bound to node-a rewrote
node-b's reservation address and fingerprint (which the arbiter pins to) and set node-a's nvidia.com/mig.config.

Real control plane only: the API server fake authenticates nobody (every request is the admin's)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent.migconfig.reconciler import CONFIG_LABEL, STATE_LABEL
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION
from tests.controlplane.cluster import ControlPlane
from tests.integration.test_slice_admission_policy import (
    NAMES_NO_NODE,
    agent_on_node_a,
    impersonating,
    installed,
    send,
    token,
)

pytestmark = pytest.mark.controlplane
__all__ = ["installed"]  # the fixture: namespace, RBAC and both policies applied, nodes node-a and node-b

OWN = {
    "metadata": {
        "labels": {STATE_LABEL: "success"},
        "annotations": {ADDRESS_ANNOTATION: "10.0.0.1:7443", FINGERPRINT_ANNOTATION: "ab" * 32},
    }
}


def patch(cp: ControlPlane, node: str, body: dict[str, Any], **who: Any) -> tuple[int, str]:
    status, answer = send(cp, "PATCH", f"/api/v1/nodes/{node}?dryRun=All", body, **who)
    return status, str((answer or {}).get("message", ""))


def wait_for_node_policy(cp: ControlPlane) -> None:
    import time

    deadline = time.monotonic() + 30
    while patch(cp, "node-b", OWN, headers=impersonating("node-a"))[0] != 403:
        assert time.monotonic() < deadline, "the Node policy is not in force after 30s"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def agent_pod(installed: ControlPlane) -> Iterator[str]:
    with agent_on_node_a(installed) as bound:
        wait_for_node_policy(installed)
        yield bound


def whos(bound_token: str) -> list[dict[str, Any]]:
    return [{"token": bound_token}, {"headers": impersonating("node-a")}]


def test_the_agent_writes_its_own_keys_on_its_own_node(installed: ControlPlane, agent_pod: str) -> None:
    for who in whos(agent_pod):
        assert patch(installed, "node-a", OWN, **who) == (200, "")
        removed = {"metadata": {"labels": {STATE_LABEL: None}, "annotations": {ADDRESS_ANNOTATION: None}}}
        assert patch(installed, "node-a", removed, **who)[0] == 200


def test_another_nodes_object_is_refused(installed: ControlPlane, agent_pod: str) -> None:
    for who in whos(agent_pod):
        status, message = patch(installed, "node-b", OWN, **who)
        assert status == 403, message
        assert "the node agent on node node-a may only change its own Node, not node-b" in message


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            {"metadata": {"labels": {CONFIG_LABEL: "all-1g.10gb"}}},
            f"may change only the label {STATE_LABEL} of its Node, not {CONFIG_LABEL}",
        ),
        ({"metadata": {"labels": {"kubernetes.io/hostname": "node-b"}}}, "not kubernetes.io/hostname"),
        (
            {"metadata": {"annotations": {"example.com/other": "x"}}},
            f"may change only the annotations {ADDRESS_ANNOTATION} and {FINGERPRINT_ANNOTATION} of its Node, "
            "not example.com/other",
        ),
        ({"spec": {"unschedulable": True}}, "may change only labels and annotations of its Node"),
        ({"spec": {"taints": [{"key": "k", "effect": "NoSchedule"}]}}, "not its spec, owners or finalizers"),
    ],
)
def test_keys_the_agent_does_not_own_are_refused_on_its_own_node(
    installed: ControlPlane, agent_pod: str, body: dict[str, Any], said: str
) -> None:
    for who in whos(agent_pod):
        status, message = patch(installed, "node-a", body, **who)
        assert status == 403, message
        assert said in message, message


def test_a_token_without_a_node_name_may_patch_no_node(installed: ControlPlane, agent_pod: str) -> None:
    for who in ({"token": token(installed)}, {"headers": impersonating(None)}):
        status, message = patch(installed, "node-a", OWN, **who)
        assert status == 403 and NAMES_NO_NODE in message, message
        assert "no such key" not in message, message


def test_the_admin_is_not_limited(installed: ControlPlane) -> None:
    assert patch(installed, "node-b", {"metadata": {"labels": {CONFIG_LABEL: "all-disabled"}}})[0] == 200
