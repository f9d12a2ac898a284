"""NVLink domains: connected components of the NVLink peer graph, or the fabric clique where reported."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from agent.devices.model import Gpu, NvlinkDomain


def assign_nvlink_domains(gpus: Sequence[Gpu]) -> tuple[tuple[Gpu, ...], tuple[NvlinkDomain, ...]]:
    """Group GPUs into NVLink domains and stamp each GPU with its domain id.

    A fabric clique `<clusterUuid>.<cliqueId>` wins: it names the same domain on every node of the clique.
    Otherwise the domain is a connected component of the local peer graph (GPUs linked directly or through
    the same NVSwitch), named after its lowest GPU uuid so the id is stable across restarts. A GPU
    without NVLink is a domain of its own.
    """
    by_bus = {g.pci_bus_id.lower(): g for g in gpus}
    parent = {g.uuid: g.uuid for g in gpus}

    def find(u: str) -> str:
        while parent[u] != u:
            parent[u] = parent[parent[u]]
            u = parent[u]
        return u

    def union(u: str, v: str) -> None:
        a, b = find(u), find(v)
        if a != b:
            parent[max(a, b)] = min(a, b)

    # A peer that is not one of our GPUs is an NVSwitch: every GPU linked to the same switch is reachable.
    first_at_switch: dict[str, str] = {}
    for g in gpus:
        for peer_bus in g.nvlink_peers:
            peer = by_bus.get(peer_bus.lower())
            if peer is not None:
                union(g.uuid, peer.uuid)
            else:
                union(g.uuid, first_at_switch.setdefault(peer_bus.lower(), g.uuid))

    groups: dict[str, list[Gpu]] = {}
    for g in gpus:
        key = g.fabric.domain_id if g.fabric else find(g.uuid)
        groups.setdefault(key, []).append(g)

    stamped: dict[str, str] = {}
    domains = []
    for key, members in groups.items():
        fabric = members[0].fabric is not None
        domain_id = key if fabric else "node-" + min(m.uuid for m in members).removeprefix("GPU-")
        for m in members:
            stamped[m.uuid] = domain_id
        domains.append(NvlinkDomain(domain_id, tuple(sorted(m.minor for m in members)), fabric))
    out = tuple(dataclasses.replace(g, nvlink_domain=stamped[g.uuid]) for g in gpus)
    return out, tuple(sorted(domains, key=lambda d: d.gpu_minors))
