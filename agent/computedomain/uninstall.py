"""`gpu-dra-agent compute-domain-controller --uninstall`: take the controller away without leaving objects that
nothing can finish.

Removed, in this order: the controller's Deployment, then, once no replica holds the Lease, our finalizer from
every ComputeDomain and from every ResourceClaimTemplate the controller made, and the Lease itself. Without the
first step a replica stopped by `helm uninstall` (which deletes its RBAC at the same moment) cannot release the
Lease, and the next install waits for it to lapse. Without the second, the domains, and with them the CRD that
the uninstall deletes, would wait for ever for a controller that is gone; their templates, owned by the
domains, are then collected with them. The domains themselves are left to whoever deletes the CRD.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.computedomain.controller import COMPONENT
from agent.computedomain.model import FINALIZER, LABEL
from agent.jsontypes import Json
from agent.kube.errors import Conflict, NotFound
from agent.kube.rest import COMPUTE_DOMAINS, LEASES, RESOURCE_CLAIM_TEMPLATES, Resource, Rest
from agent.kube.uninstall import delete, stop_controller
from agent.objects.read import meta

DEPLOYMENT = "gpu-dra-agent-compute-domains"  # daemonset/overlays/compute-domains/controller.yaml


def uninstall(
    rest: Rest,
    namespace: str,
    *,
    wait_s: float = 60.0,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The steps of the module doc, each said; returns how many objects lost our finalizer. Raises StillRunning
    (agent.kube.uninstall) when a replica keeps the Lease, ApiError when the API server refuses a step; every
    step can be run again."""
    stop_controller(rest, namespace, DEPLOYMENT, COMPONENT, wait_s=wait_s, say=say, clock=clock, sleep=sleep)
    released = 0
    for resource, kind, selector in (
        (COMPUTE_DOMAINS, "ComputeDomain", None),
        (RESOURCE_CLAIM_TEMPLATES, "ResourceClaimTemplate", LABEL),  # the controller labels the ones it makes
    ):
        try:
            items = rest.list(resource, label_selector=selector).get("items") or []
        except NotFound:  # the CRD is gone already: so are the domains
            items = []
        for obj in items:
            if _unfinalize(rest, resource, obj):
                released += 1
                say(f"removed finalizer {FINALIZER} from {kind} {meta(obj).get('namespace')}/{meta(obj).get('name')}")
    if delete(rest, LEASES, namespace, COMPONENT):
        say(f"deleted Lease {namespace}/{COMPONENT}")
    say(f"{released} object(s) released; the ComputeDomains stay until they (or their CRD) are deleted")
    return released


def _unfinalize(rest: Rest, resource: Resource, obj: Json) -> bool:
    """Our finalizer off one object, re-read on a conflict; False when it had none or is gone."""
    for _ in range(5):
        finalizers = list(meta(obj).get("finalizers") or ())
        if FINALIZER not in finalizers:
            return False
        kept = [f for f in finalizers if f != FINALIZER]
        try:
            rest.replace(resource, {**obj, "metadata": {**meta(obj), "finalizers": kept}})
            return True
        except Conflict:
            try:
                obj = rest.get(resource, str(meta(obj).get("namespace")), str(meta(obj).get("name")))
            except NotFound:
                return False
        except NotFound:
            return False
    where = f"{meta(obj).get('namespace')}/{meta(obj).get('name')}"
    raise Conflict(409, f"{resource.plural} {where} kept changing; run --uninstall again")
