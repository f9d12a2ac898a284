"""The allocator against an API server: read slices, classes and claims, write the claim's status.allocation."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

from agent.allocation.cel import Json
from fakes.scheduler import extended
from fakes.scheduler.allocator import allocate

FINALIZER = "resource.kubernetes.io/delete-protection"


class FakeScheduler:
    """What kube-scheduler's DRA plugin does for one claim, minus pods: allocate it and record the allocation."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api: Any = client.ResourceV1Api(api_client)  # Any: bodies are raw API JSON, not client models
        self._core: Any = client.CoreV1Api(api_client)

    def allocate(self, namespace: str, name: str, *, node: str | None = None) -> Json:
        """Allocate the claim (Unsatisfiable if it cannot be), write status.allocation; the updated claim."""
        claim = self._raw(self._api.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        if (claim.get("status") or {}).get("allocation"):
            return claim  # allocated already: kube-scheduler never re-allocates
        allocation = allocate(
            claim,
            self._items(self._api.list_resource_slice(_preload_content=False)),
            self._items(self._api.list_device_class(_preload_content=False)),
            self._items(self._api.list_resource_claim_for_all_namespaces(_preload_content=False)),
            node=node,
        )
        claim["status"] = {**(claim.get("status") or {}), "allocation": allocation}
        return self._raw(
            self._api.replace_namespaced_resource_claim_status(name, namespace, claim, _preload_content=False)
        )

    def deallocate(self, namespace: str, name: str) -> Json:
        """Clear status.allocation (and reservedFor), as kube-scheduler or the claim controller does."""
        claim = self._raw(self._api.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        status = {k: v for k, v in (claim.get("status") or {}).items() if k not in ("allocation", "reservedFor")}
        claim["status"] = status
        return self._raw(
            self._api.replace_namespaced_resource_claim_status(name, namespace, claim, _preload_content=False)
        )

    def schedule_extended_resources(self, namespace: str, pod_name: str, node: str) -> Json | None:
        """DRAExtendedResource for one pod on `node`: allocate the pod's extended resources that a DeviceClass
        maps through one special claim, as kube-scheduler does (see fakes.scheduler.extended): create the claim,
        write its allocation, finalizer and reservation for the pod, bind the pod, and record the request
        mappings in the pod's status. The claim; None when nothing of the pod needs DRA on that node."""
        pod = self._raw(self._core.read_namespaced_pod(pod_name, namespace, _preload_content=False))
        classes = self._items(self._api.list_device_class(_preload_content=False))
        claims = self._items(self._api.list_resource_claim_for_all_namespaces(_preload_content=False))
        found = extended.find_claim(pod, claims)
        if found is not None and (found.get("status") or {}).get("allocation"):
            return found  # allocated in an earlier cycle
        node_obj = self._raw(self._core.read_node(node, _preload_content=False))
        allocatable = (node_obj.get("status") or {}).get("allocatable") or {}
        requests = extended.device_requests(pod, extended.class_mapping(classes), allocatable)
        if not requests:
            return None
        claim = found or extended.claim_for(pod, requests)
        allocation = allocate(  # before creating the claim: an unsatisfiable pod leaves nothing behind
            claim, self._items(self._api.list_resource_slice(_preload_content=False)), classes, claims, node=node
        )
        if found is None:
            claim = self._raw(
                self._api.create_namespaced_resource_claim(namespace, claim, _preload_content=False)
            )
        name = claim["metadata"]["name"]
        claim["metadata"]["finalizers"] = sorted({*(claim["metadata"].get("finalizers") or []), FINALIZER})
        claim = self._raw(self._api.replace_namespaced_resource_claim(name, namespace, claim, _preload_content=False))
        claim["status"] = {
            "allocation": allocation,
            "reservedFor": [{"resource": "pods", "name": pod_name, "uid": pod["metadata"]["uid"]}],
        }
        claim = self._raw(
            self._api.replace_namespaced_resource_claim_status(name, namespace, claim, _preload_content=False)
        )
        status = {"extendedResourceClaimStatus": {
            "resourceClaimName": name,
            "requestMappings": extended.request_mappings(pod, claim),
        }}
        self._core.patch_namespaced_pod_status(pod_name, namespace, {"status": status}, _preload_content=False)
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod_name, "namespace": namespace},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": node}}
        self._core.create_namespaced_pod_binding(pod_name, namespace, binding, _preload_content=False)
        return claim

    @staticmethod
    def _raw(response: Any) -> Json:
        data: Json = json.loads(response.data)
        return data

    @classmethod
    def _items(cls, response: Any) -> list[Json]:
        items: list[Json] = cls._raw(response).get("items") or []
        return items
