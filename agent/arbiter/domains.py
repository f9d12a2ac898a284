"""ComputeDomain channels as the arbiter weighs them: pure, from the informers' objects.

A node in a complete, undegraded NVLink fabric clique publishes IMEX channels in its own pool of the driver
`compute-domain.nvidia.com` (agent.computedomain.channels), each with its clique as the `cliqueID` attribute; a node
in no such clique publishes none. A pod of a ComputeDomain asks for one channel per channel claim, and one claim
takes `channel-0`, so at most one pod of one domain runs on a node. The arbiter does not allocate channel claims:
it places the pod (and its GPU claims) on a node that has a free channel, inside one clique for the whole gang,
and kube-scheduler allocates the channel there once the pod is ungated for that node. A channel claim's CEL
selectors (the ComputeDomain controller pins each domain's template to one clique: agent.computedomain.cliques)
narrow the pod to the nodes whose channel they accept, so the arbiter never picks a clique kube-scheduler would
then refuse.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agent.allocation.cel import device_variable
from agent.allocation.selectors import CelSelectors
from agent.computedomain.channels import CHANNEL, CLIQUE_ATTRIBUTE
from agent.computedomain.model import CHANNEL_CLASS, DRIVER
from agent.objects.read import allocation_results, claim_requests, device_type, published_devices

CHANNEL_RESOURCE = f"{DRIVER}/channel"  # the node resource a channel claim takes (NodeSpec.other, PodSpec.other)
_SELECTORS = CelSelectors()  # compiled once per expression: one per domain's template


def is_channel_claim(claim: Mapping[str, Any]) -> bool:
    """Whether every request of the claim asks for a ComputeDomain channel (NVIDIA's template has one)."""
    requests = claim_requests(claim)
    return bool(requests) and all((r.get("exactly") or {}).get("deviceClassName") == CHANNEL_CLASS for r in requests)


def offered(slices: Iterable[Mapping[str, Any]]) -> dict[str, tuple[str, int]]:
    """node -> (its clique, the channel devices it publishes), for the nodes that publish channels."""
    out: dict[str, tuple[str, int]] = {}
    for spec, _key, d in published_devices(slices, DRIVER):
        clique = ((d.get("attributes") or {}).get(CLIQUE_ATTRIBUTE) or {}).get("string")
        if spec.get("nodeName") and device_type(d) == CHANNEL and clique:
            node = str(spec["nodeName"])
            out[node] = (str(clique), out.get(node, ("", 0))[1] + 1)
    return out


def held(claims: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """node -> its channels allocated to claims."""
    out: dict[str, int] = {}
    for c in claims:
        for r in allocation_results(c):
            if r.get("driver") == DRIVER and str(r.get("device", "")).startswith(f"{CHANNEL}-"):
                pool = str(r.get("pool"))
                out[pool] = out.get(pool, 0) + 1
    return out


def channel_selectors(claim: Mapping[str, Any]) -> tuple[str, ...]:
    """The CEL expressions of a channel claim's requests (a pinned template has one)."""
    return tuple(
        str(sel["cel"]["expression"])
        for r in claim_requests(claim)
        for sel in (r.get("exactly") or {}).get("selectors") or ()
        if isinstance(sel.get("cel"), Mapping) and "expression" in sel["cel"]
    )


def channel_nodes(expressions: tuple[str, ...], slices: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """The nodes publishing a channel every expression accepts, as kube-scheduler evaluates them (SelectorError, a
    ValueError, for an expression that cannot say)."""
    nodes = set()
    for spec, _key, d in published_devices(slices, DRIVER):
        if spec.get("nodeName") and device_type(d) == CHANNEL:
            device = device_variable(DRIVER, d)
            if all(_SELECTORS.matches(e, device) for e in expressions):
                nodes.add(str(spec["nodeName"]))
    return frozenset(nodes)
