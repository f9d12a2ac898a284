"""kube-controller-manager's resourceclaim controller, small (upstream pkg/controller/resourceclaim/controller.go):

- handlePod: for each pod-level claim from a template that the pod status does not list yet, create a claim
  (generateName `<pod>-<claim>-`, owned by the pod as controller, annotation
  `resource.kubernetes.io/pod-claim-name`) and record it in `status.resourceClaimStatuses`. Not for pods that
  are done (terminal phase, or deleted before being scheduled).
- syncClaim: drop `reservedFor` entries of pods that are gone, replaced (another uid) or done; when that leaves
  none, clear the allocation (the claim was allocated by a scheduler: it carries the finalizer
  `resource.kubernetes.io/delete-protection`) and remove the finalizer. A deleted claim with the finalizer and
  no consumers is deallocated and its finalizer removed. A generated claim nobody uses whose pod is done or
  replaced is deleted.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any

from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.informer import Informer
from agent.kube.rest import PODS, RESOURCE_CLAIMS, Rest

log = logging.getLogger(__name__)

FINALIZER = "resource.kubernetes.io/delete-protection"
POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


def is_pod_done(pod: Mapping[str, Any]) -> bool:
    """Certain never to run (again): terminal phase, or deleted while not scheduled (upstream isPodDone)."""
    meta = pod.get("metadata") or {}
    phase = (pod.get("status") or {}).get("phase")
    return phase in ("Succeeded", "Failed") or (
        bool(meta.get("deletionTimestamp")) and not (pod.get("spec") or {}).get("nodeName")
    )


class ResourceClaimController:
    def __init__(self, rest: Rest, pods: Informer, claims: Informer, templates: Informer) -> None:
        self._rest = rest
        self._pods = pods
        self._claims = claims
        self._templates = templates
        self._seen_pods: dict[str, str] = {}  # pod uid -> "ns/name": pods once known (to tell deleted from unseen)
        # claims this controller created, until the pod's status lists them: the informers may not show the new
        # claim nor the pod's new status on the next pass, and a second claim for the same pod would be made
        # (upstream keeps a mutation cache of its claims for the same reason)
        self._created: dict[tuple[str, str], Json] = {}  # (pod uid, pod-level claim name) -> claim

    def sync(self) -> int:
        """One pass over pods and claims; returns how many writes it made."""
        writes = 0
        pods = self._pods.items()
        for pod in pods:
            meta = pod.get("metadata") or {}
            self._seen_pods[str(meta.get("uid"))] = f"{meta.get('namespace')}/{meta.get('name')}"
            writes += self._handle_pod(pod)
        live = {str((pod.get("metadata") or {}).get("uid")) for pod in pods}
        self._created = {k: c for k, c in self._created.items() if k[0] in live}
        for claim in self._claims.items():
            try:
                writes += self._sync_claim(claim)
            except (Conflict, NotFound):
                continue  # changed meanwhile: the next pass sees the new version
            except ApiError as e:
                log.warning("claim %s: %s", (claim.get("metadata") or {}).get("name"), e)
        return writes

    # -- pods -----------------------------------------------------------------------------------------------

    def _handle_pod(self, pod: Json) -> int:
        if is_pod_done(pod) or (pod.get("metadata") or {}).get("deletionTimestamp"):
            return 0
        meta = pod["metadata"]
        ns = meta["namespace"]
        listed = {s.get("name") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()}
        for name in listed:
            self._created.pop((meta["uid"], name), None)
        new_statuses = []
        for rc in (pod.get("spec") or {}).get("resourceClaims") or ():
            template_name = rc.get("resourceClaimTemplateName")
            if not template_name or rc["name"] in listed:
                continue
            existing = self._owned_claim(pod, rc["name"])
            if existing is None:
                template = self._templates.get(ns, template_name)
                if template is None:
                    continue  # upstream reports an error and retries: the template may come later
                tspec = template.get("spec") or {}
                tmeta = tspec.get("metadata") or {}
                body = {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {
                        "generateName": f"{meta['name']}-{rc['name']}-"[:58],
                        "namespace": ns,
                        "labels": dict(tmeta.get("labels") or {}),
                        "annotations": {**(tmeta.get("annotations") or {}), POD_CLAIM_NAME: rc["name"]},
                        "ownerReferences": [
                            {
                                "apiVersion": "v1",
                                "kind": "Pod",
                                "name": meta["name"],
                                "uid": meta["uid"],
                                "controller": True,
                                "blockOwnerDeletion": True,
                            }
                        ],
                    },
                    "spec": copy.deepcopy(tspec.get("spec") or {}),
                }
                try:
                    existing = self._rest.create(RESOURCE_CLAIMS, ns, body)
                except ApiError as e:
                    log.warning("creating a claim for %s/%s: %s", ns, meta["name"], e)
                    continue
                self._created[(meta["uid"], rc["name"])] = existing
            new_statuses.append({"name": rc["name"], "resourceClaimName": existing["metadata"]["name"]})
        if not new_statuses:
            return 0
        try:
            current = self._rest.get(PODS, ns, meta["name"])
            if current["metadata"]["uid"] != meta["uid"]:
                return 0
            status = current.setdefault("status", {})
            known = {s.get("name") for s in status.get("resourceClaimStatuses") or ()}
            status["resourceClaimStatuses"] = [
                *(status.get("resourceClaimStatuses") or ()),
                *(s for s in new_statuses if s["name"] not in known),
            ]
            current.setdefault("kind", "Pod")
            self._rest.replace(PODS, current, "status")
        except (Conflict, NotFound):
            return 0
        return len(new_statuses)

    def _owned_claim(self, pod: Json, claim_name: str) -> Json | None:
        uid = pod["metadata"]["uid"]
        if (uid, claim_name) in self._created:
            return self._created[(uid, claim_name)]
        for c in self._claims.items():
            meta = c.get("metadata") or {}
            if (
                meta.get("namespace") == pod["metadata"]["namespace"]
                and (meta.get("annotations") or {}).get(POD_CLAIM_NAME) == claim_name
                and any(o.get("uid") == uid and o.get("controller") for o in meta.get("ownerReferences") or ())
            ):
                return c
        return None

    # -- claims ---------------------------------------------------------------------------------------------

    def _pod_valid(self, ns: str, ref: Mapping[str, Any]) -> bool:
        pod = self._pods.get(ns, str(ref.get("name")))
        if pod is None:
            if ref.get("uid") in self._seen_pods:
                return False  # seen before and gone: deleted
            try:  # never seen: ask the server before dropping a consumer the scheduler may be placing
                pod = self._rest.get(PODS, ns, str(ref.get("name")))
            except NotFound:
                return False
        if pod["metadata"].get("uid") != ref.get("uid"):
            return False
        return not is_pod_done(pod)

    def _sync_claim(self, claim: Json) -> int:
        meta = claim["metadata"]
        ns = meta["namespace"]
        status = claim.get("status") or {}
        reserved = status.get("reservedFor") or []
        valid = [
            r for r in reserved if r.get("resource") == "pods" and not r.get("apiGroup") and self._pod_valid(ns, r)
        ] + [r for r in reserved if r.get("resource") != "pods" or r.get("apiGroup")]
        has_finalizer = FINALIZER in (meta.get("finalizers") or ())
        writes = 0
        if len(valid) < len(reserved):
            body = copy.deepcopy(claim)
            body.setdefault("kind", "ResourceClaim")
            body.setdefault("status", {})["reservedFor"] = valid
            if not valid and has_finalizer:
                body["status"].pop("allocation", None)
            written = self._rest.replace(RESOURCE_CLAIMS, body, "status")
            writes += 1
            if has_finalizer and not (written.get("status") or {}).get("allocation"):
                written["metadata"]["finalizers"] = [f for f in written["metadata"]["finalizers"] if f != FINALIZER]
                self._rest.replace(RESOURCE_CLAIMS, written)
                writes += 1
        elif has_finalizer and meta.get("deletionTimestamp") and not valid:
            body = copy.deepcopy(claim)
            body.setdefault("kind", "ResourceClaim")
            if status.get("allocation"):
                body["status"].pop("allocation", None)
                body = self._rest.replace(RESOURCE_CLAIMS, body, "status")
                writes += 1
            body["metadata"]["finalizers"] = [f for f in body["metadata"]["finalizers"] if f != FINALIZER]
            self._rest.replace(RESOURCE_CLAIMS, body)
            writes += 1
        if not valid:
            writes += self._delete_if_orphaned(claim)
        return writes

    def _delete_if_orphaned(self, claim: Json) -> int:
        meta = claim["metadata"]
        if meta.get("deletionTimestamp"):
            return 0
        owner = next(
            (
                o
                for o in meta.get("ownerReferences") or ()
                if o.get("controller") and o.get("apiVersion") == "v1" and o.get("kind") == "Pod"
            ),
            None,
        )
        if owner is None:
            return 0
        pod = self._pods.get(meta["namespace"], str(owner.get("name")))
        if pod is None:
            return 0  # maybe not known yet: upstream leaves a truly deleted pod's claims to the garbage collector
        if pod["metadata"].get("uid") != owner.get("uid") or is_pod_done(pod):
            self._rest.delete(RESOURCE_CLAIMS, meta["namespace"], meta["name"])
            return 1
        return 0
