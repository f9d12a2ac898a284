"""The ComputeDomain object (resource.nvidia.com/v1beta1) read and written as NVIDIA's driver does, without I/O.

A domain's status.nodes has one entry per node running its IMEX daemon: the node's address, its fabric clique, an
index unique within the clique (the lowest free one, so names stay put when nodes leave), and whether the daemon
is ready. Only the entries of one clique form one IMEX domain: nodes of another clique never join their config.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.jsontypes import Json

GROUP = "resource.nvidia.com"
VERSION = "v1beta1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "ComputeDomain"
PLURAL = "computedomains"
DRIVER = "compute-domain.nvidia.com"
CHANNEL_CLASS = "compute-domain-default-channel.nvidia.com"
DAEMON_CLASS = "compute-domain-daemon.nvidia.com"
# NVIDIA's label and finalizer key, so objects made by either driver read alike
LABEL = "resource.nvidia.com/computeDomain"
TARGET_LABEL = "resource.nvidia.com/computeDomainTarget"
FINALIZER = LABEL
READY, NOT_READY = "Ready", "NotReady"
SINGLE, ALL = "Single", "All"
MAX_NODES_PER_CLIQUE = 18  # an NVL72 rack: the most nodes one IMEX domain spans (NVIDIA's maxNodesPerIMEXDomain)


class InvalidComputeDomain(ValueError):
    """The object cannot be a ComputeDomain this driver serves; the message says which field and why."""


@dataclass(frozen=True)
class DomainNode:
    """One entry of status.nodes."""

    name: str
    ip_address: str
    clique_id: str
    index: int
    status: str = NOT_READY

    def to_json(self) -> Json:
        return {
            "name": self.name,
            "ipAddress": self.ip_address,
            "cliqueID": self.clique_id,
            "index": self.index,
            "status": self.status,
        }


@dataclass(frozen=True)
class ComputeDomain:
    namespace: str
    name: str
    uid: str
    num_nodes: int
    template_name: str
    allocation_mode: str
    nodes: tuple[DomainNode, ...] = ()
    status: str = NOT_READY
    deleting: bool = False
    finalizers: tuple[str, ...] = ()


def parse(obj: Mapping[str, Any]) -> ComputeDomain:
    """A ComputeDomain from its JSON (as the API server returns it, defaults applied or not)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    channel = spec.get("channel")
    where = f"ComputeDomain {meta.get('namespace')}/{meta.get('name')}"
    if not isinstance(channel, Mapping):
        raise InvalidComputeDomain(f"{where}: spec.channel is required")
    template = (channel.get("resourceClaimTemplate") or {}).get("name")
    if not isinstance(template, str) or not template:
        raise InvalidComputeDomain(f"{where}: spec.channel.resourceClaimTemplate.name is required")
    mode = channel.get("allocationMode") or SINGLE
    if mode not in (SINGLE, ALL):
        raise InvalidComputeDomain(f"{where}: spec.channel.allocationMode must be Single or All, not {mode!r}")
    num_nodes = spec.get("numNodes", 0)
    if not isinstance(num_nodes, int) or isinstance(num_nodes, bool) or num_nodes < 0:
        raise InvalidComputeDomain(f"{where}: spec.numNodes must be an integer of at least 0, not {num_nodes!r}")
    status = obj.get("status") or {}
    return ComputeDomain(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        uid=str(meta.get("uid") or ""),
        num_nodes=num_nodes,
        template_name=template,
        allocation_mode=mode,
        nodes=tuple(parse_node(n) for n in status.get("nodes") or () if isinstance(n, Mapping)),
        status=str(status.get("status") or NOT_READY),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(meta.get("finalizers") or ()),
    )


def parse_node(raw: Mapping[str, Any]) -> DomainNode:
    index = raw.get("index")
    return DomainNode(
        str(raw.get("name") or ""),
        str(raw.get("ipAddress") or ""),
        str(raw.get("cliqueID") or ""),
        index if isinstance(index, int) else -1,
        str(raw.get("status") or NOT_READY),
    )


def global_status(num_nodes: int, nodes: Sequence[DomainNode]) -> str:
    """Ready once at least numNodes daemons are listed and every listed one is ready (NVIDIA's rule)."""
    if len(nodes) < num_nodes:
        return NOT_READY
    return NOT_READY if any(n.status != READY for n in nodes) else READY


def free_index(nodes: Iterable[DomainNode], clique_id: str, limit: int = MAX_NODES_PER_CLIQUE) -> int:
    """The lowest index no node of the clique holds; ValueError when the clique is full."""
    taken = {n.index for n in nodes if n.clique_id == clique_id}
    index = next(i for i in range(len(taken) + 1) if i not in taken)
    if index >= limit:
        raise ValueError(f"clique {clique_id} already has {limit} nodes in this ComputeDomain")
    return index


def with_node(
    nodes: Sequence[DomainNode], node_name: str, ip_address: str, clique_id: str, status: str
) -> tuple[DomainNode, ...]:
    """status.nodes with this node's entry added or updated (its index kept while its clique is the same)."""
    mine = next((n for n in nodes if n.name == node_name), None)
    others = [n for n in nodes if n.name != node_name]
    index = (
        mine.index
        if mine is not None and mine.clique_id == clique_id and mine.index >= 0
        else (free_index(others, clique_id))
    )
    entry = DomainNode(node_name, ip_address, clique_id, index, status)
    return tuple(entry if n.name == node_name else n for n in nodes) if mine is not None else (*nodes, entry)


def without_node(nodes: Sequence[DomainNode], node_name: str) -> tuple[DomainNode, ...]:
    return tuple(n for n in nodes if n.name != node_name)


def clique_peers(nodes: Iterable[DomainNode], clique_id: str) -> tuple[str, ...]:
    """The addresses one IMEX domain spans: the nodes of this clique only, in index order."""
    return tuple(
        n.ip_address
        for n in sorted(
            (n for n in nodes if n.clique_id == clique_id and n.ip_address), key=lambda n: (n.index, n.name)
        )
    )


def nodes_json(nodes: Iterable[DomainNode]) -> list[Json]:
    return [n.to_json() for n in nodes]
