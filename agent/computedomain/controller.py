"""The ComputeDomain controller: each domain's channel ResourceClaimTemplate, its overall status, its clean-up.

For every ComputeDomain it
- puts its finalizer on the domain, so nothing it made outlives it;
- makes the ResourceClaimTemplate `spec.channel.resourceClaimTemplate.name` in the domain's namespace (one request
  of the default-channel class, the domain's UID and allocation mode as opaque config), owned by the domain;
- keeps `status.status` Ready while at least numNodes IMEX daemons are listed in status.nodes and all are ready
  (the node agents write their own entries);
- on deletion deletes the template, removes its finalizer from it, then from the domain.
A name already taken by a template of something else is left alone and told in a Warning Event on the domain.

It runs as its own Deployment (`gpu-dra-agent compute-domain-controller`), not inside the arbiter: ComputeDomains
must work for pods that kube-scheduler places, with or without the arbiter installed, and NVIDIA's controller is a
component of its own too. It keeps no state: everything is read again from the API on each pass.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from agent.computedomain import model, templates
from agent.computedomain.model import FINALIZER, ComputeDomain, InvalidComputeDomain
from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.events import EventRecorder
from agent.kube.informer import Informer
from agent.kube.rest import COMPUTE_DOMAINS, RESOURCE_CLAIM_TEMPLATES, Resource, Rest

log = logging.getLogger(__name__)

COMPONENT = "gpu-dra-compute-domains"


class ComputeDomainController:
    def __init__(self, rest: Rest, *, period_s: float = 10.0, recorder: EventRecorder | None = None) -> None:
        self._rest = rest
        self._period_s = period_s
        self._recorder = recorder
        self._wake = threading.Event()
        self._told: dict[str, str] = {}  # domain uid -> the last warning told about it
        self.domains = Informer(rest, COMPUTE_DOMAINS, self._wake.set, optional=True)

    def start(self) -> ComputeDomainController:
        self.domains.start()
        return self

    def stop(self) -> None:
        self.domains.stop()
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        """Reconcile every domain on each change and every `period_s` until `stop`."""
        while not stop.is_set():
            self._wake.clear()
            self.reconcile_all()
            self._wake.wait(self._period_s)

    def reconcile_all(self) -> None:
        for obj in self.domains.items():
            meta = obj.get("metadata") or {}
            try:
                self.reconcile(str(meta.get("namespace")), str(meta.get("name")))
            except ApiError as exc:  # the next pass tries again; one domain never stops the others
                log.warning("ComputeDomain %s/%s: %s", meta.get("namespace"), meta.get("name"), exc)

    def reconcile(self, namespace: str, name: str) -> None:
        try:
            obj = self._rest.get(COMPUTE_DOMAINS, namespace, name)
        except NotFound:
            return
        try:
            domain = model.parse(obj)
        except InvalidComputeDomain as exc:
            self._warn(obj, "InvalidComputeDomain", str(exc))
            return
        if domain.deleting:
            self._clean_up(obj, domain)
            return
        if FINALIZER not in domain.finalizers:
            obj["metadata"]["finalizers"] = [*domain.finalizers, FINALIZER]
            obj = self._rest.replace(COMPUTE_DOMAINS, obj)
        self._ensure_template(obj, domain)
        self._update_status(obj)

    # --- the parts ---------------------------------------------------------------------------------------

    def _ensure_template(self, obj: Json, domain: ComputeDomain) -> None:
        try:
            existing = self._rest.get(RESOURCE_CLAIM_TEMPLATES, domain.namespace, domain.template_name)
        except NotFound:
            try:
                self._rest.create(RESOURCE_CLAIM_TEMPLATES, domain.namespace, templates.channel_template(domain))
            except Conflict:
                return  # made meanwhile: checked on the next pass
            log.info(
                "ComputeDomain %s/%s: created ResourceClaimTemplate %s",
                domain.namespace,
                domain.name,
                domain.template_name,
            )
            return
        if not templates.belongs_to(existing, domain.uid):
            self._warn(
                obj,
                "ResourceClaimTemplateTaken",
                f"ResourceClaimTemplate {domain.namespace}/{domain.template_name} exists and is not this "
                "ComputeDomain's; delete it or name another template in spec.channel.resourceClaimTemplate",
            )

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

    def _warn(self, obj: Json, reason: str, message: str) -> None:
        uid = str((obj.get("metadata") or {}).get("uid"))
        if self._told.get(uid) == message:
            return
        self._told[uid] = message
        log.warning("%s", message)
        if self._recorder is not None:
            self._recorder.record(obj, model.KIND, model.API_VERSION, reason, message, type_="Warning")


def _drop_finalizer(rest: Rest, resource: Resource, obj: Json) -> None:
    finalizers = list((obj.get("metadata") or {}).get("finalizers") or [])
    if FINALIZER not in finalizers:
        return
    obj["metadata"]["finalizers"] = [f for f in finalizers if f != FINALIZER]
    with contextlib.suppress(NotFound):
        rest.replace(resource, obj)
