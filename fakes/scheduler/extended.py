"""kube-scheduler's DRAExtendedResource, small: a pod that asks for an extended resource a DeviceClass maps gets
its devices through one special ResourceClaim, shaped as upstream's dynamicresources plugin shapes it
(kubernetes/kubernetes pkg/scheduler/framework/plugins/dynamicresources/extendedresources.go,
`preFilterExtendedResources`, `createDeviceRequests`, `createRequestMappings`):

- a DeviceClass maps `spec.extendedResourceName` and, implicitly, `deviceclass.resource.kubernetes.io/<class>`;
- the claim: generateName `<pod>-extended-resources-`, the pod as controlling owner, the annotation
  `resource.kubernetes.io/extended-resource-claim: "true"`;
- one `exactly` request (ExactCount, count = the quantity) per container and mapped resource, named
  `container-<i>-request-<j>`: i indexes initContainers then containers, j the resource among the container's
  request names sorted; requests sorted by name;
- a node whose allocatable already offers the resource (a device plugin) serves it without DRA;
- the pod's `status.extendedResourceClaimStatus` maps each request back to its container and resource.

Pure: API JSON dicts in and out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from agent import quantity
from agent.jsontypes import Json

CLAIM_ANNOTATION = "resource.kubernetes.io/extended-resource-claim"
IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"


def class_mapping(device_classes: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Extended resource name -> DeviceClass name, explicit and implicit names both."""
    mapping: dict[str, str] = {}
    for device_class in device_classes:
        name = device_class["metadata"]["name"]
        mapping[IMPLICIT_PREFIX + name] = name
        explicit = (device_class.get("spec") or {}).get("extendedResourceName")
        if explicit:
            mapping[explicit] = name
    return mapping


def _containers(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    spec = pod.get("spec") or {}
    return [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]


def _requests(container: Mapping[str, Any]) -> dict[str, str]:
    """A container's requests; an extended resource given only as a limit is requested at the limit (the API
    server defaults requests from limits)."""
    resources = container.get("resources") or {}
    return {**(resources.get("limits") or {}), **(resources.get("requests") or {})}


def device_requests(
    pod: Mapping[str, Any], mapping: Mapping[str, str], node_allocatable: Mapping[str, str] | None = None
) -> list[Json]:
    """The special claim's requests for the pod on a node; empty when nothing needs DRA there."""
    allocatable = node_allocatable or {}
    out: list[Json] = []
    for i, container in enumerate(_containers(pod)):
        requests = _requests(container)
        names = sorted(requests)
        for resource, value in requests.items():
            device_class = mapping.get(resource)
            count = int(quantity.parse(str(value)))
            if device_class is None or count == 0 or quantity.parse(str(allocatable.get(resource, "0"))) > 0:
                continue
            out.append(
                {
                    "name": f"container-{i}-request-{names.index(resource)}",
                    "exactly": {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count},
                }
            )
    return sorted(out, key=lambda r: r["name"])


def claim_for(pod: Mapping[str, Any], requests: list[Json]) -> Json:
    meta = pod["metadata"]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "generateName": f"{meta['name']}-extended-resources-",
            "namespace": meta.get("namespace", "default"),
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
            "annotations": {CLAIM_ANNOTATION: "true"},
        },
        "spec": {"devices": {"requests": requests}},
    }


def find_claim(pod: Mapping[str, Any], claims: Iterable[Mapping[str, Any]]) -> Json | None:
    """The pod's special claim from an earlier cycle: annotated, and controlled by this pod (by uid)."""
    uid = pod["metadata"]["uid"]
    for claim in claims:
        meta = claim.get("metadata") or {}
        if (meta.get("annotations") or {}).get(CLAIM_ANNOTATION) != "true":
            continue
        if any(o.get("controller") and o.get("uid") == uid for o in meta.get("ownerReferences") or []):
            return dict(claim)
    return None


def request_mappings(pod: Mapping[str, Any], claim: Mapping[str, Any]) -> list[Json]:
    """status.extendedResourceClaimStatus.requestMappings: which container and resource each request serves."""
    wanted = {r["name"] for r in claim["spec"]["devices"]["requests"]}
    out = []
    for i, container in enumerate(_containers(pod)):
        names = sorted(_requests(container))
        for j, resource in enumerate(names):
            if f"container-{i}-request-{j}" in wanted:
                out.append(
                    {
                        "containerName": container["name"],
                        "resourceName": resource,
                        "requestName": f"container-{i}-request-{j}",
                    }
                )
    return out
