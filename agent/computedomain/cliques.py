"""Which NVLink clique a ComputeDomain's pods go to when kube-scheduler places them, without I/O.

A constraint (matchAttribute) spans the devices of one claim, never the claims of different pods, so kube-scheduler
alone could put a domain's pods in two cliques (two IMEX domains that cannot talk). But every pod of a domain gets
its channel claim from the one template the controller makes: the controller picks the domain's clique and writes
it into that template as a CEL selector on the channel's `cliqueID` attribute, so every channel, and with it every
pod, lands in that clique. The arbiter honours the selector too (agent.arbiter.domains.channel_nodes).

The pick, from the channel slices, the GPU slices and the allocated claims:
- a clique can take the domain when at least numNodes of its nodes (one for numNodes 0) publish a channel that no
  other domain's claim holds (a channel is one device: one domain a node);
- among those, the ones where that many nodes also have a GPU free come first, so the pick is not a clique with no
  room now; then the smallest that fits (best fit: the large cliques stay for the large domains) or, for numNodes 0,
  whose size is not known, the roomiest; then the clique ID, so equal inputs give equal picks;
- none can take it now (other domains hold its channels): the clique that can hold it once they end, the one
  with the most channels free first (no fit at all: the largest clique, which holds it once enough of its nodes'
  fabric is whole). Its pods wait with kube-scheduler's "cannot allocate all claims" and run when room comes, with
  no pod to recreate; the controller tells why in an Event on the domain. Only when no node publishes a channel
  at all does the template name no clique.
The pick is kept in the template (its annotation and its selector), so a restarted controller keeps it. A
template's spec is immutable: it is remade with a new pick only while no claim of the domain exists, since claims
copy the template and a remade one would split the domain.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.computedomain.channels import CHANNEL, CLIQUE_ATTRIBUTE
from agent.computedomain.model import DRIVER
from agent.objects.read import allocated_devices, device_type, published_devices

ANNOTATION = "compute-domain.gpu-dra-agent.io/clique"  # the template's pick; "" when no clique fitted
NONE = ""


@dataclass(frozen=True)
class NodeRoom:
    """One node that publishes a channel: its clique, whether another domain holds its channel, its free GPUs."""

    clique: str
    taken: bool
    free_gpus: int


@dataclass(frozen=True)
class Pick:
    clique: str  # NONE: no node publishes a channel
    why: str  # for the domain's Event
    now: bool  # the clique can take the domain now (else its pods wait for room there)


@dataclass(frozen=True)
class Fabric:
    """One pass's reading of the slices and claims, shared by every domain's pick: read once, not once a domain."""

    cliques: Mapping[str, str]  # node -> its clique, for every node that publishes a channel
    holders: Mapping[str, frozenset[str | None]]  # node -> the domains whose claims hold its channel
    free_gpus: Mapping[str, int]  # node -> its GPUs no claim holds

    def rooms(self, domain_uid: str) -> dict[str, NodeRoom]:
        """node -> its room as `domain_uid` sees it (its own claims take nothing from it)."""
        return {
            node: NodeRoom(
                clique, bool(self.holders.get(node, frozenset()) - {domain_uid}), self.free_gpus.get(node, 0)
            )
            for node, clique in self.cliques.items()
        }


def read_fabric(slices: Iterable[Mapping[str, Any]], claims: Iterable[Mapping[str, Any]], gpu_driver: str) -> Fabric:
    """Each channel-publishing node's clique, the domains holding its channel and its free GPUs."""
    slices = list(slices)
    cliques: dict[str, str] = {}
    for spec, _key, device in published_devices(slices, DRIVER):
        clique = ((device.get("attributes") or {}).get(CLIQUE_ATTRIBUTE) or {}).get("string")
        if spec.get("nodeName") and device_type(device) == CHANNEL and clique:
            cliques[str(spec["nodeName"])] = str(clique)
    holders: dict[str, set[str | None]] = {}
    used_gpus: set[tuple[str, str]] = set()
    for claim in claims:
        used_gpus.update(allocated_devices(claim, gpu_driver))
        for pool, name in allocated_devices(claim, DRIVER):
            if name.startswith(CHANNEL):
                holders.setdefault(pool, set()).add(domain_of(claim))
    free: dict[str, int] = {}
    for spec, key, device in published_devices(slices, gpu_driver):
        node = spec.get("nodeName")
        if node in cliques and device_type(device) == "gpu" and key not in used_gpus:
            free[str(node)] = free.get(str(node), 0) + 1
    return Fabric(cliques, {node: frozenset(held) for node, held in holders.items()}, free)


def domain_of(claim: Mapping[str, Any]) -> str | None:
    """The ComputeDomain UID a claim's compute-domain config names (claims made from a domain's template)."""
    for entry in ((claim.get("spec") or {}).get("devices") or {}).get("config") or ():
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") == DRIVER:
            domain = (opaque.get("parameters") or {}).get("domainID")
            if isinstance(domain, str) and domain:
                return domain
    return None


def fits(rooms: Mapping[str, NodeRoom], clique: str, num_nodes: int) -> bool:
    """Whether enough of the clique's nodes have a channel no other domain holds: it can take the domain now."""
    return _enough(rooms, clique, num_nodes, taken_too=False)


def holds(rooms: Mapping[str, NodeRoom], clique: str, num_nodes: int) -> bool:
    """Whether the clique has enough nodes publishing a channel to take the domain once other domains end."""
    return _enough(rooms, clique, num_nodes, taken_too=True)


def _enough(rooms: Mapping[str, NodeRoom], clique: str, num_nodes: int, *, taken_too: bool) -> bool:
    counted = sum(1 for r in rooms.values() if r.clique == clique and (taken_too or not r.taken))
    return clique != NONE and counted >= max(num_nodes, 1)


def choose(rooms: Mapping[str, NodeRoom], num_nodes: int) -> Pick:
    """The domain's clique (see the module's doc)."""
    if not rooms:
        return Pick(
            NONE, "no node publishes IMEX channels (no node's GPUs are all in one complete fabric clique)", False
        )
    need = max(num_nodes, 1)
    size: dict[str, int] = {}
    open_nodes: dict[str, int] = {}
    roomy: dict[str, int] = {}
    for r in rooms.values():
        size[r.clique] = size.get(r.clique, 0) + 1
        open_nodes[r.clique] = open_nodes.get(r.clique, 0) + (not r.taken)
        roomy[r.clique] = roomy.get(r.clique, 0) + (not r.taken and r.free_gpus > 0)
    fitting = [c for c, n in open_nodes.items() if n >= need]
    if not fitting:
        large = [c for c, n in size.items() if n >= need]
        best = min(large or size, key=lambda c: (-open_nodes[c], -size[c], c))
        held = size[best] - open_nodes[best]
        wait = (
            f"other domains hold {held} of its channels; its pods wait until they end"
            if large
            else f"its pods wait until {need - size[best]} more of its nodes are in its complete fabric"
        )
        return Pick(
            best,
            f"no NVLink clique can take this domain's {need} node(s) now: {len(size)} clique(s) publish IMEX "
            f"channels, the most nodes with a channel free of other domains in one is {max(open_nodes.values())}; "
            f"clique {best} ({size[best]} node(s) with a channel) is pinned: {wait}",
            False,
        )

    def rank(clique: str) -> tuple[bool, int, int, str]:
        short = roomy[clique] < need
        if num_nodes == 0 or short:
            return (short, -roomy[clique], -open_nodes[clique], clique)
        return (short, open_nodes[clique], 0, clique)

    best = min(fitting, key=rank)
    return Pick(
        best,
        f"clique {best}: {open_nodes[best]} node(s) with a free channel, {roomy[best]} of them with a free GPU, "
        f"for {need} node(s)",
        True,
    )


def selector(clique: str) -> str:
    """The channel request's CEL selector for `clique` (NONE matches no channel: published cliques are never
    empty)."""
    return f"device.attributes[{json.dumps(DRIVER)}].{CLIQUE_ATTRIBUTE} == {json.dumps(clique)}"


def pinned(template: Mapping[str, Any]) -> str | None:
    """The clique a template was made for (NONE: none fitted); None for a template made before cliques were
    picked (no annotation)."""
    value = ((template.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
    return value if isinstance(value, str) else None
