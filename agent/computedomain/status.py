"""This node's entry of a ComputeDomain's status.nodes, written as NVIDIA's daemons write theirs.

Read, change, write back with the resourceVersion read (the status subresource): a Conflict means another node
or the controller wrote meanwhile, and the change is made again on the fresh object after a short jittered wait
(agent.kube.backoff; the nodes of a domain that forms write together). status.status is computed in the same
write, so readers never see the two disagree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from agent.computedomain import model
from agent.computedomain.model import ComputeDomain, DomainNode
from agent.jsontypes import Json
from agent.kube.backoff import SPREAD, Backoff
from agent.kube.errors import Conflict, NotFound
from agent.kube.rest import COMPUTE_DOMAINS, Rest

log = logging.getLogger(__name__)
ATTEMPTS = 10
FIRST_RETRY_S, MAX_RETRY_S = 0.01, 0.5  # after a Conflict: ~3 s at most over every attempt


def set_entry(
    rest: Rest, namespace: str, name: str, *, node_name: str, ip_address: str, clique_id: str, status: str
) -> ComputeDomain | None:
    """Add or update this node's entry; the domain as written, None when it is gone."""
    return _write(rest, namespace, name, lambda d: model.with_node(d.nodes, node_name, ip_address, clique_id, status))


def remove_entry(rest: Rest, namespace: str, name: str, node_name: str) -> ComputeDomain | None:
    return _write(rest, namespace, name, lambda d: model.without_node(d.nodes, node_name))


Change = Callable[[ComputeDomain], tuple[DomainNode, ...]]


def _write(rest: Rest, namespace: str, name: str, change: Change) -> ComputeDomain | None:
    backoff = Backoff(FIRST_RETRY_S, MAX_RETRY_S, jitter=SPREAD)
    for attempt in range(ATTEMPTS):
        if attempt:
            time.sleep(backoff.next())
        try:
            obj: Json = rest.get(COMPUTE_DOMAINS, namespace, name)
        except NotFound:
            return None
        domain = model.parse(obj)
        nodes = change(domain)
        status = {
            **(obj.get("status") or {}),
            "nodes": model.nodes_json(nodes),
            "status": model.global_status(domain.num_nodes, nodes),
        }
        if status == obj.get("status"):
            return domain
        obj["status"] = status
        try:
            return model.parse(rest.replace(COMPUTE_DOMAINS, obj, "status"))
        except NotFound:
            return None
        except Conflict:
            continue
    raise Conflict(409, f"ComputeDomain {namespace}/{name}: status changed under every one of {ATTEMPTS} writes")
