"""Which nodes a pod may run on, as kube-scheduler 1.37's NodeUnschedulable, NodeAffinity and TaintToleration
filters decide.

The arbiter chooses a pod's node and kube-scheduler then binds it there (the arbiter narrows the pod's node
affinity to that node), so a node kube-scheduler would refuse must never be chosen: the pod would stay pending
with its GPUs allocated. The rules, worded and counted as kube-scheduler reports them:
- NodeUnschedulable: a cordoned node (`spec.unschedulable`) only for a pod tolerating the NoSchedule taint
  `node.kubernetes.io/unschedulable`.
- NodeAffinity: every `nodeSelector` label equal, and one of the required affinity's `nodeSelectorTerms`
  matching (a term with no requirement matches nothing; `matchFields` knows `metadata.name` alone; `Gt`/`Lt`
  compare integers, a value that is not one never matches).
- TaintToleration: every NoSchedule and NoExecute taint of the node tolerated (PreferNoSchedule only scores).
  A toleration matches on effect (empty: any), key (empty: any; validation allows that with `Exists` only)
  and value (`Equal`, the default) or not (`Exists`), as core/v1 Toleration.ToleratesTaint does. `Gt`/`Lt`
  tolerations are behind an alpha gate that is off by default, and tolerate nothing, as there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from agent.arbiter.fit_error import fit_error

Json = Mapping[str, Any]  # read here, never written: any mapping (agent.jsontypes.Json is a dict)

AFFINITY = "node(s) didn't match Pod's node affinity/selector"  # kube-scheduler's words for each refusal
TAINTS = "node(s) had untolerated taint(s)"
UNSCHEDULABLE = "node(s) were unschedulable"
_CORDONED = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
_NOT_SCHEDULED_ON = ("NoSchedule", "NoExecute")


def _holds(requirement: Json, value: str | None) -> bool:
    op = requirement.get("operator")
    values = list(requirement.get("values") or ())
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            have, bound = int(value), int(values[0])
        except ValueError:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def selector_allows(selector: Json | None, node: Json) -> bool:
    """A core/v1 NodeSelector: its terms ORed, each term's requirements ANDed. No selector allows every node."""
    if selector is None:
        return True
    m = node.get("metadata") or {}
    labels, name = m.get("labels") or {}, m.get("name")
    for term in selector.get("nodeSelectorTerms") or ():
        exprs, fields = term.get("matchExpressions") or (), term.get("matchFields") or ()
        if not exprs and not fields:
            continue
        if all(_holds(e, labels.get(e.get("key"))) for e in exprs) and all(
            _holds(f, name if f.get("key") == "metadata.name" else None) for f in fields
        ):
            return True
    return False


def _required_affinity(spec: Json) -> Json | None:
    return ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )


def _affinity_allows(pod: Json, node: Json) -> bool:
    """The pod's `nodeSelector` and required node affinity both match the node."""
    spec = pod.get("spec") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    return selector_allows(_required_affinity(spec), node)


def tolerates(toleration: Json, taint: Json) -> bool:
    """core/v1 Toleration.ToleratesTaint; DRA's DeviceToleration matches alike (resourceclaim.ToleratesTaint)."""
    effect, key = toleration.get("effect") or "", toleration.get("key") or ""
    if effect and effect != taint.get("effect"):
        return False
    if key and key != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return op == "Exists"


def _untolerated(node: Json, tolerations: Sequence[Json]) -> bool:
    """Whether the node has a NoSchedule or NoExecute taint no toleration tolerates."""
    return any(
        taint.get("effect") in _NOT_SCHEDULED_ON and not any(tolerates(t, taint) for t in tolerations)
        for taint in (node.get("spec") or {}).get("taints") or ()
    )


def refusal(pod: Json, node: Json) -> str | None:
    """Why kube-scheduler would not bind `pod` to `node` (in its words), or None when it would allow it."""
    tolerations = (pod.get("spec") or {}).get("tolerations") or ()
    if (node.get("spec") or {}).get("unschedulable") and not any(tolerates(t, _CORDONED) for t in tolerations):
        return UNSCHEDULABLE
    if not _affinity_allows(pod, node):
        return AFFINITY
    if _untolerated(node, tolerations):
        return TAINTS
    return None


def rules_key(pod: Json) -> str:
    """The pod's node rules (nodeSelector, required node affinity, tolerations) as one string: pods with equal
    keys are allowed on the same nodes. A caller may keep it per version of the pod."""
    spec = pod.get("spec") or {}
    rules = (spec.get("nodeSelector"), _required_affinity(spec), spec.get("tolerations"))
    # orjson: the standard library's dumps was 7 % of the cycle thread's time in the bench (issue 37)
    return orjson.dumps(rules, option=orjson.OPT_SORT_KEYS).decode()


class NodeRules:
    """The nodes each pod may run on among `nodes`, worked out once per distinct set of rules (the members of
    a gang, and most pods of a cluster, share theirs)."""

    def __init__(self, nodes: Sequence[Json]) -> None:
        self._nodes = nodes
        self._tainted = any(
            t.get("effect") in _NOT_SCHEDULED_ON for n in nodes for t in (n.get("spec") or {}).get("taints") or ()
        )
        self._seen: dict[str, tuple[frozenset[str] | None, str]] = {}

    def allowed(self, pod: Json, key: str) -> tuple[frozenset[str] | None, str]:
        """The names of the nodes that allow `pod` (its `rules_key` is `key`), None when all of them do; and when
        none does, why, as kube-scheduler says it ("0/3 nodes are available: 3 node(s) had untolerated taint(s).")."""
        spec = pod.get("spec") or {}
        if not self._tainted and spec.get("nodeSelector") is None and _required_affinity(spec) is None:
            return None, ""  # tolerations alone restrict nothing while no node is tainted
        known = self._seen.get(key)
        if known is None:
            known = self._seen[key] = self._work_out(pod)
        return known

    def _work_out(self, pod: Json) -> tuple[frozenset[str] | None, str]:
        allowed: set[str] = set()
        refused: dict[str, int] = {}
        for node in self._nodes:
            why = refusal(pod, node)
            if why is None:
                allowed.add(str((node.get("metadata") or {}).get("name")))
            else:
                refused[why] = refused.get(why, 0) + 1
        if len(allowed) == len(self._nodes):
            return None, ""
        return frozenset(allowed), fit_error(len(self._nodes), refused) if not allowed else ""
