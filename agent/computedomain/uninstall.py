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

from collections.abc import Callable

from agent.computedomain.controller import COMPONENT
from agent.computedomain.model import FINALIZER, LABEL
from agent.jsontypes import Json
from agent.kube.errors import Conflict, NotFound
from agent.kube.rest import COMPUTE_DOMAINS, RESOURCE_CLAIM_TEMPLATES, Resource, Rest
from agent.kube.uninstall import Controller
from agent.objects.read import meta

DEPLOYMENT = "gpu-dra-agent-compute-domains"  # daemonset/overlays/compute-domains/controller.yaml


def _release(rest: Rest, say: Callable[[str], None]) -> str:
    """Our finalizer off every ComputeDomain and every template the controller made, once no replica runs."""
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
    return f"{released} object(s) released; the ComputeDomains stay until they (or their CRD) are deleted"


COMPUTE_DOMAIN_CONTROLLER = Controller(DEPLOYMENT, COMPONENT, _release)  # agent.kube.uninstall runs it


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
