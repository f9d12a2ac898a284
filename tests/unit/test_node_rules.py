"""Which nodes kube-scheduler lets a pod run on (NodeUnschedulable, NodeAffinity, TaintToleration), as the
arbiter must know before it picks one: each case is a rule of kube-scheduler 1.37.2's filters."""

from __future__ import annotations

from typing import Any

import pytest

from agent.arbiter.node_rules import (
    AFFINITY,
    TAINTS,
    UNSCHEDULABLE,
    NodeRules,
    refusal,
    rules_key,
    selector_allows,
    tolerates,
)


def node(name: str = "a", taints: list[dict[str, str]] | None = None, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}, "spec": {"taints": taints or []}}


def pod(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p"}, "spec": spec}


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": op, "values": list(values)} if values else {"key": key, "operator": op}


@pytest.mark.parametrize(
    ("selector", "allowed"),
    [
        ({"nodeSelectorTerms": [{"matchFields": [expr("metadata.name", "In", "a")]}]}, True),
        ({"nodeSelectorTerms": [{"matchFields": [expr("metadata.name", "In", "b")]}]}, False),
        ({"nodeSelectorTerms": [{"matchFields": [expr("metadata.name", "NotIn", "b")]}]}, True),
        (
            {
                "nodeSelectorTerms": [
                    {"matchExpressions": [expr("zone", "In", "x")]},
                    {"matchFields": [expr("metadata.name", "In", "a")]},
                ]
            },
            True,
        ),
        (
            {
                "nodeSelectorTerms": [
                    {"matchExpressions": [expr("zone", "Exists")], "matchFields": [expr("metadata.name", "In", "a")]}
                ]
            },
            False,
        ),
        ({"nodeSelectorTerms": [{}]}, False),
        ({"nodeSelectorTerms": [{"matchExpressions": [expr("zone", "NotIn", "x")]}]}, True),
        ({"nodeSelectorTerms": [{"matchExpressions": [expr("zone", "DoesNotExist")]}]}, True),
        ({"nodeSelectorTerms": [{"matchExpressions": [expr("gpus", "Gt", "4")]}]}, True),
        ({"nodeSelectorTerms": [{"matchExpressions": [expr("gpus", "Lt", "8")]}]}, False),
        ({"nodeSelectorTerms": [{"matchExpressions": [expr("model", "Gt", "4")]}]}, False),
    ],
    ids=[
        "name-matches",
        "other-name",
        "name-not-in",
        "terms-are-ored",
        "requirements-are-anded",
        "empty-term-matches-nothing",
        "not-in-matches-a-missing-label",
        "does-not-exist",
        "gt",
        "lt",
        "gt-on-a-word-never-matches",
    ],
)
def test_node_selectors_as_kube_scheduler_reads_them(selector: dict[str, Any], allowed: bool) -> None:
    assert selector_allows(selector, node(gpus="8", model="h100")) is allowed


NO_SCHEDULE = {"key": "dedicated", "value": "train", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("toleration", "tolerated"),
    [
        ({"key": "dedicated", "value": "train", "effect": "NoSchedule"}, True),
        ({"key": "dedicated", "operator": "Equal", "value": "train"}, True),  # no effect: every effect
        ({"key": "dedicated", "value": "serve"}, False),
        ({"key": "dedicated", "operator": "Exists"}, True),
        ({"operator": "Exists"}, True),  # no key, Exists: every taint
        ({"operator": "Equal", "value": "train"}, True),  # no key, Equal: every key with that value (as upstream)
        ({"value": "serve", "effect": "NoSchedule"}, False),
        ({"key": "dedicated", "operator": "Exists", "effect": "NoExecute"}, False),
        ({"key": "other", "operator": "Exists"}, False),
        ({"key": "dedicated", "operator": "Gt", "value": "1"}, False),  # behind an alpha gate, off by default
    ],
)
def test_tolerations_as_kube_scheduler_reads_them(toleration: dict[str, str], tolerated: bool) -> None:
    assert tolerates(toleration, NO_SCHEDULE) is tolerated


def test_why_a_node_refuses_a_pod() -> None:
    tainted = node(taints=[NO_SCHEDULE, {"key": "soft", "effect": "PreferNoSchedule"}], zone="x")
    assert refusal(pod(), tainted) == TAINTS
    assert refusal(pod(tolerations=[{"key": "dedicated", "operator": "Exists"}]), tainted) is None  # Prefer: scores
    assert refusal(pod(nodeSelector={"zone": "y"}), node(zone="x")) == AFFINITY
    assert refusal(pod(nodeSelector={"zone": "x"}), node(zone="x")) is None
    assert refusal(pod(), node(taints=[{"key": "evict", "effect": "NoExecute"}])) == TAINTS
    cordoned = {**node(), "spec": {"unschedulable": True}}
    assert refusal(pod(), cordoned) == UNSCHEDULABLE
    assert (
        refusal(
            pod(
                tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists", "effect": "NoSchedule"}]
            ),
            cordoned,
        )
        is None
    )


def allowed(rules: NodeRules, p: dict[str, Any]) -> tuple[frozenset[str] | None, str]:
    return rules.allowed(p, rules_key(p))


def test_the_nodes_a_pod_may_run_on_and_why_none() -> None:
    rules = NodeRules([node("a", zone="x"), node("b", zone="y"), node("c", [NO_SCHEDULE], zone="x")])
    assert allowed(rules, pod()) == (frozenset({"a", "b"}), "")
    assert allowed(rules, pod(nodeSelector={"zone": "x"}, tolerations=[{"operator": "Exists"}])) == (
        frozenset({"a", "c"}),
        "",
    )
    assert allowed(rules, pod(tolerations=[{"operator": "Exists"}])) == (None, "")  # every node: no restriction
    assert allowed(rules, pod(nodeSelector={"zone": "z"})) == (
        frozenset(),
        ("0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector."),
    )
    assert allowed(
        rules,
        pod(
            nodeSelector={"zone": "x"},
            affinity={
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchFields": [expr("metadata.name", "In", "c")]}]
                    }
                }
            },
        ),
    ) == (
        frozenset(),
        (
            "0/3 nodes are available: 1 node(s) had untolerated taint(s), "
            "2 node(s) didn't match Pod's node affinity/selector."
        ),
    )
    untainted = NodeRules([node("a"), node("b")])
    assert allowed(untainted, pod(tolerations=[{"key": "k", "operator": "Exists"}])) == (None, "")
