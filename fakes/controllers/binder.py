"""kube-scheduler binding ungated pods, small: what the arbiter relies on it for.

For a pod with no scheduling gates and no node (and the default scheduler), the candidate nodes are those:
- its `nodeSelector`, required node affinity and tolerations allow (the NodeUnschedulable, NodeAffinity and
  TaintToleration filters: `agent.arbiter.node_rules`);
- with room for what it asks (NodeResourcesFit, counted as `agent.objects.read.pod_requests` counts it);
- that every allocated claim's `allocation.nodeSelector` allows (the DRA plugin's Filter).
Claims not yet allocated are allocated on the first candidate where all fit (fakes.scheduler's structured
allocator, as the plugin does), with the finalizer `resource.kubernetes.io/delete-protection`. DeviceTaintRules
add their taint to the devices they select before allocating, as kube-scheduler's slice lister does, so a device
under a NoSchedule rule goes only to a request tolerating it. In PreBind each claim gets the pod in `reservedFor`;
then the pod is bound (pods/binding). Nodes are tried in name order; there is no scoring and no preemption.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence

from agent.arbiter.node_rules import refusal, selector_allows
from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.informer import Informer, Key, key_of
from agent.kube.rest import RESOURCE_CLAIMS, Rest
from agent.objects.read import allocatable, pod_requests
from fakes.scheduler.allocator import Unsatisfiable, allocate, with_rule_taints

log = logging.getLogger(__name__)

FINALIZER = "resource.kubernetes.io/delete-protection"


Taken = dict[str, dict[str, float]]  # node -> what the pods bound there ask of it (pod_requests, summed)


def _take(taken: Taken, node: str, asked: Mapping[str, float]) -> None:
    on_node = taken.setdefault(node, {})
    for resource, amount in asked.items():
        on_node[resource] = on_node.get(resource, 0.0) + amount


def _subrequest_score(claims: Sequence[Json], allocations: Mapping[str, Json]) -> int:
    """kube-scheduler's computeScore: for each subrequest allocated, 8 (the most a list may have) less its index."""
    score = 0
    for c in claims:
        allocation = allocations.get(c["metadata"]["name"]) or (c.get("status") or {}).get("allocation") or {}
        chosen = {r.get("request") for r in (allocation.get("devices") or {}).get("results") or ()}
        for r in ((c.get("spec") or {}).get("devices") or {}).get("requests") or ():
            for i, sub in enumerate(r.get("firstAvailable") or ()):
                if f"{r.get('name')}/{sub.get('name')}" in chosen:
                    score += 8 - i
    return score


def _has_room(node: Json, asked: Mapping[str, float], taken: Taken) -> bool:
    """NodeResourcesFit: what the pods bound there ask, and this one, within the node's allocatable."""
    free, used = allocatable(node), taken.get(node["metadata"]["name"], {})
    return all(free.get(r, 0.0) - used.get(r, 0.0) >= amount for r, amount in asked.items() if amount)


class Binder:
    def __init__(
        self,
        rest: Rest,
        pods: Informer,
        claims: Informer,
        nodes: Informer,
        slices: Informer,
        classes: Informer,
        taint_rules: Informer | None = None,
    ) -> None:
        self._rest = rest
        self._pods = pods
        self._claims = claims
        self._nodes = nodes
        self._slices = slices
        self._classes = classes
        self._taint_rules = taint_rules
        # kube-scheduler's assume cache: allocations this binder wrote that its claim informer may not show yet
        # (key -> the resourceVersion written, the claim as written); without it, the next pod's allocation can
        # pick a device the last one just took
        self._assumed: dict[Key, tuple[int, Json]] = {}

    def _known_claims(self) -> list[Json]:
        """Every claim as the informer shows it, or as this binder last wrote it where the informer lags. An
        assumption ends once the informer catches up, or no longer has the claim."""
        out, lagging = [], {}
        for c in self._claims.items():
            key = key_of(c)
            assumed = self._assumed.get(key)
            if assumed is not None and int(c["metadata"].get("resourceVersion") or 0) < assumed[0]:
                lagging[key] = assumed
                out.append(assumed[1])
            else:
                out.append(c)
        self._assumed = lagging
        return out

    def sync(self) -> int:
        bound = 0
        pods = self._pods.items()
        taken: Taken = {}  # node -> what the pods bound there (and not done) ask: NodeResourcesFit's count
        for p in pods:
            node = (p.get("spec") or {}).get("nodeName")
            if node and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                _take(taken, node, pod_requests(p))
        for pod in pods:
            spec = pod.get("spec") or {}
            meta = pod.get("metadata") or {}
            if spec.get("nodeName") or spec.get("schedulingGates") or meta.get("deletionTimestamp"):
                continue
            if spec.get("schedulerName") not in (None, "", "default-scheduler"):
                continue
            try:
                bound += self._schedule(pod, taken)
            except (Conflict, NotFound):
                continue  # changed meanwhile: the next pass tries again
            except ApiError as e:
                log.warning("scheduling %s/%s: %s", meta.get("namespace"), meta.get("name"), e)
        return bound

    def _claims_of(self, pod: Json) -> list[Json] | None:
        ns = pod["metadata"]["namespace"]
        statuses = {
            s.get("name"): s.get("resourceClaimName")
            for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
        }
        out = []
        for rc in (pod.get("spec") or {}).get("resourceClaims") or ():
            name = rc.get("resourceClaimName") or statuses.get(rc.get("name"))
            claim = self._claims.get(ns, name) if name else None
            if claim is None:
                return None  # the claim is not there yet: unschedulable for now (upstream PreFilter)
            out.append(claim)
        return out

    def _schedule(self, pod: Json, taken: Taken) -> int:
        claims = self._claims_of(pod)
        if claims is None:
            return 0
        nodes = sorted(self._nodes.items(), key=lambda n: n["metadata"]["name"])
        asked = pod_requests(pod)
        # kube-scheduler's DynamicResources Score prefers the node where a prioritized list's earlier subrequest
        # fits (computeScore); without such a claim the first node that fits is taken
        prioritized = any(
            r.get("firstAvailable")
            for c in claims
            if not (c.get("status") or {}).get("allocation")
            for r in ((c.get("spec") or {}).get("devices") or {}).get("requests") or ()
        )
        best: tuple[int, str, dict[str, Json]] | None = None
        for node in nodes:
            if refusal(pod, node) is not None or not _has_room(node, asked, taken):
                continue
            if not all(
                selector_allows((c.get("status") or {}).get("allocation", {}).get("nodeSelector"), node)
                for c in claims
                if (c.get("status") or {}).get("allocation")
            ):
                continue
            allocations = self._allocate(claims, node["metadata"]["name"])
            if allocations is None:
                continue
            score = _subrequest_score(claims, allocations)
            if best is None or score > best[0]:
                best = (score, node["metadata"]["name"], allocations)
            if not prioritized:
                break
        if best is None:
            return 0
        _, name, allocations = best
        self._pre_bind(pod, claims, allocations)
        self._bind(pod, name)
        _take(taken, name, asked)
        return 1

    def _allocate(self, claims: Sequence[Json], node: str) -> dict[str, Json] | None:
        pending = [c for c in claims if not (c.get("status") or {}).get("allocation")]
        if not pending:
            return {}
        everything = self._known_claims()
        slices = with_rule_taints(self._slices.items(), self._taint_rules.items() if self._taint_rules else ())
        out: dict[str, Json] = {}
        for c in pending:
            try:
                allocation = allocate(c, slices, self._classes.items(), everything, node=node)
            except Unsatisfiable:
                return None
            out[c["metadata"]["name"]] = allocation
            everything.append({**c, "status": {"allocation": allocation}})
        return out

    def _pre_bind(self, pod: Json, claims: Sequence[Json], allocations: Mapping[str, Json]) -> None:
        ref = {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        for claim in claims:
            reserved = (claim.get("status") or {}).get("reservedFor") or []
            name = claim["metadata"]["name"]
            if any(r.get("uid") == ref["uid"] for r in reserved) and name not in allocations:
                continue
            body = copy.deepcopy(claim)
            body.setdefault("kind", "ResourceClaim")
            if name in allocations and FINALIZER not in (body["metadata"].get("finalizers") or ()):
                body["metadata"]["finalizers"] = [*(body["metadata"].get("finalizers") or ()), FINALIZER]
                body = self._rest.replace(RESOURCE_CLAIMS, body)
            status = body.setdefault("status", {})
            if name in allocations:
                status["allocation"] = allocations[name]
            status["reservedFor"] = [*reserved, ref]
            written = self._rest.replace(RESOURCE_CLAIMS, body, "status")
            if name in allocations:
                self._assumed[key_of(written)] = (int(written["metadata"].get("resourceVersion") or 0), written)

    def _bind(self, pod: Json, node: str) -> None:
        meta = pod["metadata"]
        self._rest.bind(meta["namespace"], meta["name"], node)
