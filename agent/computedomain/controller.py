"""The ComputeDomain controller: each domain's channel ResourceClaimTemplate, its overall status, its clean-up.

For every ComputeDomain it
- puts its finalizer on the domain, so nothing it made outlives it;
- makes the ResourceClaimTemplate `spec.channel.resourceClaimTemplate.name` in the domain's namespace (one request
  of the default-channel class, the domain's UID and allocation mode as opaque config), owned by the domain, its
  channel pinned by a selector to the clique picked for the domain (agent.computedomain.cliques: the pick from the
  slices and claims its informers hold, told in an Event), so kube-scheduler keeps every pod of the domain in one
  clique; remade with a new pick while no claim of the domain exists and its clique no longer fits;
- keeps `status.status` Ready while at least numNodes IMEX daemons are listed in status.nodes and all are ready
  (the node agents write their own entries);
- on deletion deletes the template, removes its finalizer from it, then from the domain.
A name already taken by a template of something else is left alone and told in a Warning Event on the domain.

It runs as its own Deployment (`gpu-dra-agent compute-domain-controller`), not inside the arbiter: ComputeDomains
must work for pods that kube-scheduler places, with or without the arbiter installed, and NVIDIA's controller is a
component of its own too. It keeps no state: each pass reads the domains, their templates, the slices and the
claims from its informers (the clique's inputs once for all domains), and reads the API itself only before it
remakes a template, where a claim the informer has not seen yet must not be split from its domain.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from collections.abc import Mapping

from agent.computedomain import cliques, model, templates
from agent.computedomain.model import FINALIZER, ComputeDomain, InvalidComputeDomain
from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.events import EventRecorder
from agent.kube.informer import Informer
from agent.kube.rest import (
    COMPUTE_DOMAINS,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Resource,
    Rest,
)
from agent.slices.build import DEFAULT_DRIVER

log = logging.getLogger(__name__)

COMPONENT = "gpu-dra-compute-domains"  # also its Lease: only the holder writes (--leader-elect)


class ComputeDomainController:
    def __init__(
        self,
        rest: Rest,
        *,
        period_s: float = 10.0,
        recorder: EventRecorder | None = None,
        gpu_driver: str = DEFAULT_DRIVER,
    ) -> None:
        self._rest = rest
        self._gpu_driver = gpu_driver
        self._period_s = period_s
        self._recorder = recorder
        self._wake = threading.Event()
        self._told: dict[str, str] = {}  # domain uid -> the last warning told about it
        self.domains = Informer(rest, COMPUTE_DOMAINS, self._wake.set, optional=True)
        # what the clique pick reads; a new or changed slice may let a waiting domain fit, claims come and go too
        # often to wake on (the period catches a channel another domain let go)
        self.slices = Informer(rest, RESOURCE_SLICES, self._wake.set)
        self.claims = Informer(rest, RESOURCE_CLAIMS)
        self.templates = Informer(rest, RESOURCE_CLAIM_TEMPLATES)  # a template changed or gone: the period sees it
        self._informers = (self.domains, self.slices, self.claims, self.templates)

    def start(self) -> ComputeDomainController:
        for informer in self._informers:
            informer.start()
        return self

    def stop(self) -> None:
        for informer in self._informers:
            informer.stop()
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Reconcile every domain on each change and every `period_s` until `stop`."""
        while not stop.is_set():
            self._wake.clear()
            self.reconcile_all()
            self._wake.wait(self._period_s)

    def reconcile_all(self) -> None:
        domains = self.domains.items()
        if not domains:
            return
        # a pick from half-listed slices could pin a worse clique, or none: the next pass picks
        synced = all(informer.wait_synced(0) for informer in (self.slices, self.claims, self.templates))
        fabric = cliques.read_fabric(self.slices.items(), self.claims.items(), self._gpu_driver) if synced else None
        for shared in domains:
            meta = shared.get("metadata") or {}
            try:
                self.reconcile(copy.deepcopy(shared), fabric)  # the informer's object is shared: edited on a copy
            except NotFound:
                continue  # deleted meanwhile: nothing left to do for it
            except Conflict as exc:  # the informer's copy was behind: it brings the newer one and wakes a pass
                log.info("ComputeDomain %s/%s changed meanwhile: %s", meta.get("namespace"), meta.get("name"), exc)
            except ApiError as exc:  # the next pass tries again; one domain never stops the others
                log.warning("ComputeDomain %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)

    def reconcile(self, obj: Json, fabric: cliques.Fabric | None) -> None:
        """One domain, as the informer holds it (the caller's copy); `fabric`: None until the informers the clique's
        pick reads have listed."""
        try:
            domain = model.parse(obj)
        except InvalidComputeDomain as exc:
            self._tell(obj, "InvalidComputeDomain", str(exc))
            return
        if domain.deleting:
            self._clean_up(obj, domain)
            return
        if FINALIZER not in domain.finalizers:
            obj["metadata"]["finalizers"] = [*domain.finalizers, FINALIZER]
            obj = self._rest.replace(COMPUTE_DOMAINS, obj)
        if fabric is not None:
            self._ensure_template(obj, domain, fabric)
        self._update_status(obj)

    # --- the parts ---------------------------------------------------------------------------------------

    def _ensure_template(self, obj: Json, domain: ComputeDomain, fabric: cliques.Fabric) -> None:
        rooms = fabric.rooms(domain.uid)
        existing = self.templates.get(domain.namespace, domain.template_name)
        if existing is None:  # made already and not seen yet: the create is refused (Conflict), the next pass sees it
            self._create_template(obj, domain, cliques.choose(rooms, domain.num_nodes))
            return
        if not templates.belongs_to(existing, domain.uid):
            self._tell(
                obj,
                "ResourceClaimTemplateTaken",
                f"ResourceClaimTemplate {domain.namespace}/{domain.template_name} exists and is not this "
                "ComputeDomain's; delete it or name another template in spec.channel.resourceClaimTemplate",
            )
            return
        have = cliques.pinned(existing)
        if have is not None and cliques.fits(rooms, have, domain.num_nodes):
            return
        pick = cliques.choose(rooms, domain.num_nodes)
        if pick.clique == have:
            self._tell(obj, "NoCliqueFits", pick.why)
            return
        if self._has_claims(domain):  # claims copied the template: a new pin would split the domain
            self._tell_claims_hold(obj, domain, rooms, have, pick)
            return  # its clique still holds the domain: the pods wait for room there
        # Deleted before it is looked at again: kube-controller-manager makes a pod's claim only from a template
        # that exists (as its informer last saw it), so a claim made from the old pin after the look above is
        # seen by the second look; then the template is made again as it was, and the domain stays in one clique.
        if (existing.get("metadata") or {}).get("deletionTimestamp") is None:
            self._rest.delete(
                RESOURCE_CLAIM_TEMPLATES,
                domain.namespace,
                domain.template_name,
                preconditions={"uid": existing["metadata"]["uid"]},
            )
            with contextlib.suppress(NotFound):
                existing = self._rest.get(RESOURCE_CLAIM_TEMPLATES, domain.namespace, domain.template_name)
        _drop_finalizer(self._rest, RESOURCE_CLAIM_TEMPLATES, existing)
        if self._has_claims(domain):
            log.info(
                "ComputeDomain %s/%s: a claim was made from its template meanwhile: kept", domain.namespace, domain.name
            )
            self._create(domain, have)
            self._tell_claims_hold(obj, domain, rooms, have, pick)
            return
        log.info("ComputeDomain %s/%s: remaking its template (clique %r)", domain.namespace, domain.name, have)
        self._create_template(obj, domain, pick)

    def _tell_claims_hold(
        self,
        obj: Json,
        domain: ComputeDomain,
        rooms: Mapping[str, cliques.NodeRoom],
        have: str | None,
        pick: cliques.Pick,
    ) -> None:
        """Claims of the domain copied its template's pin (`have`): say so when that clique cannot hold it."""
        if have is not None and cliques.holds(rooms, have, domain.num_nodes):
            return
        was = f"clique {have} can no longer take this domain" if have else "no clique fitted this domain"
        self._tell(
            obj,
            "CliqueLost" if have else "NoCliqueFits",
            f"{was} when ResourceClaimTemplate {domain.template_name} was made, and its pods' claims copy "
            f"it; delete those pods (their claims go with them) for the template to be remade: {pick.why}",
        )

    def _create_template(self, obj: Json, domain: ComputeDomain, pick: cliques.Pick) -> None:
        if not self._create(domain, pick.clique):
            return  # made meanwhile, or the old one not gone yet: checked on the next pass
        log.info(
            "ComputeDomain %s/%s: created ResourceClaimTemplate %s (%s)",
            domain.namespace,
            domain.name,
            domain.template_name,
            pick.why,
        )
        if pick.now:
            self._tell(obj, "CliquePicked", pick.why, type_="Normal")
        else:
            self._tell(obj, "NoCliqueFits", pick.why)

    def _create(self, domain: ComputeDomain, clique: str | None) -> bool:
        try:
            self._rest.create(RESOURCE_CLAIM_TEMPLATES, domain.namespace, templates.channel_template(domain, clique))
        except Conflict:
            return False
        return True

    def _has_claims(self, domain: ComputeDomain) -> bool:
        """Read now, not from the informer: a claim it has not seen yet must not be split from its domain."""
        claims = self._rest.list(RESOURCE_CLAIMS, domain.namespace)["items"]
        return any(cliques.domain_of(c) == domain.uid for c in claims)

    def _update_status(self, obj: Json) -> None:
        """status.status from status.nodes of the domain as this pass read (or wrote) it, written only when it
        changes (a Conflict: a node agent wrote its entry meanwhile, with status.status; the next pass sees both)."""
        domain = model.parse(obj)
        want = model.global_status(domain.num_nodes, domain.nodes)
        if (obj.get("status") or {}).get("status") == want:
            return
        obj["status"] = {**(obj.get("status") or {}), "status": want}
        with contextlib.suppress(Conflict):
            self._rest.replace(COMPUTE_DOMAINS, obj, "status")
            log.info("ComputeDomain %s/%s is %s", domain.namespace, domain.name, want)

    def _clean_up(self, obj: Json, domain: ComputeDomain) -> None:
        with contextlib.suppress(NotFound):
            template = self._rest.get(RESOURCE_CLAIM_TEMPLATES, domain.namespace, domain.template_name)
            if templates.belongs_to(template, domain.uid):
                if not (template.get("metadata") or {}).get("deletionTimestamp"):
                    self._rest.delete(
                        RESOURCE_CLAIM_TEMPLATES,
                        domain.namespace,
                        domain.template_name,
                        preconditions={"uid": template["metadata"]["uid"]},
                    )
                    template = self._rest.get(RESOURCE_CLAIM_TEMPLATES, domain.namespace, domain.template_name)
                _drop_finalizer(self._rest, RESOURCE_CLAIM_TEMPLATES, template)
        if FINALIZER in domain.finalizers:
            _drop_finalizer(self._rest, COMPUTE_DOMAINS, obj)
            log.info("ComputeDomain %s/%s: cleaned up", domain.namespace, domain.name)
        self._told.pop(domain.uid, None)

    def _tell(self, obj: Json, reason: str, message: str, type_: str = "Warning") -> None:
        """An Event on the domain, once per change of what is told."""
        uid = str((obj.get("metadata") or {}).get("uid"))
        if self._told.get(uid) == message:
            return
        self._told[uid] = message
        log.log(logging.WARNING if type_ == "Warning" else logging.INFO, "%s", message)
        if self._recorder is not None:
            self._recorder.record(obj, model.KIND, model.API_VERSION, reason, message, type_=type_)


def _drop_finalizer(rest: Rest, resource: Resource, obj: Json) -> None:
    """Our finalizer off `obj` (left as it is: it may be an informer's)."""
    meta = obj.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    if FINALIZER not in finalizers:
        return
    with contextlib.suppress(NotFound):
        rest.replace(resource, {**obj, "metadata": {**meta, "finalizers": [f for f in finalizers if f != FINALIZER]}})
