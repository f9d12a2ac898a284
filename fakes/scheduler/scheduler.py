"""The allocator against an API server: read slices, classes and claims, write the claim's status.allocation."""

from __future__ import annotations

from agent.jsontypes import Json
from agent.kube.rest import DEVICE_CLASSES, NODES, PODS, RESOURCE_CLAIMS, RESOURCE_SLICES, Resource, Rest
from fakes.scheduler import extended
from fakes.scheduler.allocator import allocate

FINALIZER = "resource.kubernetes.io/delete-protection"


class FakeScheduler:
    """What kube-scheduler's DRA plugin does for one claim, minus pods: allocate it and record the allocation."""

    def __init__(self, rest: Rest) -> None:
        self._rest = rest

    def allocate(self, namespace: str, name: str, *, node: str | None = None) -> Json:
        """Allocate the claim (Unsatisfiable if it cannot be), write status.allocation; the updated claim."""
        claim = self._rest.get(RESOURCE_CLAIMS, namespace, name)
        if (claim.get("status") or {}).get("allocation"):
            return claim  # allocated already: kube-scheduler never re-allocates
        allocation = allocate(
            claim,
            self._items(RESOURCE_SLICES),
            self._items(DEVICE_CLASSES),
            self._items(RESOURCE_CLAIMS),
            node=node,
        )
        claim["status"] = {**(claim.get("status") or {}), "allocation": allocation}
        return self._rest.replace(RESOURCE_CLAIMS, claim, "status")

    def deallocate(self, namespace: str, name: str) -> Json:
        """Clear status.allocation (and reservedFor), as kube-scheduler or the claim controller does."""
        claim = self._rest.get(RESOURCE_CLAIMS, namespace, name)
        status = {k: v for k, v in (claim.get("status") or {}).items() if k not in ("allocation", "reservedFor")}
        claim["status"] = status
        return self._rest.replace(RESOURCE_CLAIMS, claim, "status")

    def schedule_extended_resources(self, namespace: str, pod_name: str, node: str) -> Json | None:
        """DRAExtendedResource for one pod on `node`: allocate the pod's extended resources that a DeviceClass
        maps through one special claim, as kube-scheduler does (see fakes.scheduler.extended): create the claim,
        write its allocation, finalizer and reservation for the pod, bind the pod, and record the request
        mappings in the pod's status. The claim; None when nothing of the pod needs DRA on that node."""
        pod = self._rest.get(PODS, namespace, pod_name)
        classes = self._items(DEVICE_CLASSES)
        claims = self._items(RESOURCE_CLAIMS)
        found = extended.find_claim(pod, claims)
        if found is not None and (found.get("status") or {}).get("allocation"):
            return found  # allocated in an earlier cycle
        node_obj = self._rest.get(NODES, None, node)
        allocatable = (node_obj.get("status") or {}).get("allocatable") or {}
        requests = extended.device_requests(pod, extended.class_mapping(classes), allocatable)
        if not requests:
            return None
        claim = found or extended.claim_for(pod, requests)
        allocation = allocate(  # before creating the claim: an unsatisfiable pod leaves nothing behind
            claim, self._items(RESOURCE_SLICES), classes, claims, node=node
        )
        if found is None:
            claim = self._rest.create(RESOURCE_CLAIMS, namespace, claim)
        name = claim["metadata"]["name"]
        claim["metadata"]["finalizers"] = sorted({*(claim["metadata"].get("finalizers") or []), FINALIZER})
        claim = self._rest.replace(RESOURCE_CLAIMS, claim)
        claim["status"] = {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": pod_name, "uid": pod["metadata"]["uid"]}],
        }
        claim = self._rest.replace(RESOURCE_CLAIMS, claim, "status")
        status = {
            "extendedResourceClaimStatus": {
                "resourceClaimName": name,
                "requestMappings": extended.request_mappings(pod, claim),
            }
        }
        self._rest.patch(PODS, namespace, pod_name, {"status": status}, subresource="status")
        self._rest.bind(namespace, pod_name, node)
        return claim

    def _items(self, resource: Resource) -> list[Json]:
        items: list[Json] = self._rest.list(resource).get("items") or []
        return items
