"""Fields behind a disabled feature gate are dropped on write, as the registry strategies' PrepareForCreate and
PrepareForUpdate do (`dropDisabledFields` in k8s.io/kubernetes pkg/registry/resource/resourceslice/strategy.go,
pkg/registry/resource/deviceclass/strategy.go, pkg/registry/resource/resourceclaim/strategy.go and
pkg/api/pod/util.go). A field the old object already uses is kept, so an update never loses it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from agent.jsontypes import Json

from .versions import KubernetesVersion


def _devices(obj: Json | None) -> list[Json]:
    return [d for d in ((obj or {}).get("spec") or {}).get("devices") or [] if isinstance(d, dict)]


def _in_use(old: Json | None, used: Callable[[Json], bool]) -> bool:
    return old is not None and used(old)


def _slice_taints(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    if gates.enabled("DRADeviceTaints") or _in_use(old, lambda o: any(d.get("taints") for d in _devices(o))):
        return
    for device in _devices(new):
        device.pop("taints", None)


def _slice_partitionable(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    def used(o: Json) -> bool:
        spec = o.get("spec") or {}
        return (
            bool(spec.get("sharedCounters"))
            or "perDeviceNodeSelection" in spec
            or any(
                d.get("consumesCounters") or any(k in d for k in ("nodeName", "nodeSelector", "allNodes"))
                for d in _devices(o)
            )
        )

    if gates.enabled("DRAPartitionableDevices") or _in_use(old, used):
        return
    spec = new.get("spec") or {}
    spec.pop("sharedCounters", None)
    spec.pop("perDeviceNodeSelection", None)
    for device in _devices(new):
        for name in ("consumesCounters", "nodeName", "nodeSelector", "allNodes"):
            device.pop(name, None)


def _slice_binding_conditions(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    names = ("bindingConditions", "bindingFailureConditions", "bindsToNode")
    on = gates.enabled("DRADeviceBindingConditions") and gates.enabled("DRAResourceClaimDeviceStatus")
    if on or _in_use(old, lambda o: any(n in d for d in _devices(o) for n in names)):
        return
    for device in _devices(new):
        for name in names:
            device.pop(name, None)


def _slice_consumable_capacity(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    def used(o: Json) -> bool:
        return any(
            "allowMultipleAllocations" in d
            or any(isinstance(c, dict) and "requestPolicy" in c for c in (d.get("capacity") or {}).values())
            for d in _devices(o)
        )

    if gates.enabled("DRAConsumableCapacity") or _in_use(old, used):
        return
    for device in _devices(new):
        device.pop("allowMultipleAllocations", None)
        for capacity in (device.get("capacity") or {}).values():
            if isinstance(capacity, dict):
                capacity.pop("requestPolicy", None)


_NODE_ALLOCATABLE = ("nodeAllocatableResourceMappings", "nodeAllocatableResources")  # 1.36 name, 1.37 name
_LIST_ATTRIBUTES = ("bools", "ints", "strings", "versions")


def _slice_alpha_fields(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    if not gates.enabled("DRANodeAllocatableResources") and not _in_use(
        old, lambda o: any(n in d for d in _devices(o) for n in _NODE_ALLOCATABLE)
    ):
        for device in _devices(new):
            for name in _NODE_ALLOCATABLE:
                device.pop(name, None)

    def list_attributes(o: Json) -> Iterator[Json]:
        for device in _devices(o):
            yield from (a for a in (device.get("attributes") or {}).values() if isinstance(a, dict))

    if not gates.enabled("DRAListTypeAttributes") and not _in_use(
        old, lambda o: any(n in a for a in list_attributes(o) for n in _LIST_ATTRIBUTES)
    ):
        for attribute in list_attributes(new):
            for name in _LIST_ATTRIBUTES:
                attribute.pop(name, None)
    if not gates.enabled("DRAResourcePoolStatus") and not _in_use(
        old, lambda o: "partitionTypeAttribute" in (o.get("spec") or {})
    ):
        (new.get("spec") or {}).pop("partitionTypeAttribute", None)


def _device_class(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    if gates.enabled("DRAExtendedResource") or _in_use(old, lambda o: "extendedResourceName" in (o.get("spec") or {})):
        return
    (new.get("spec") or {}).pop("extendedResourceName", None)


def _claim_requests(spec: Json | None) -> Iterator[Json]:
    """Every exact request and subrequest of a claim spec (where tolerations and capacity live)."""
    for request in ((spec or {}).get("devices") or {}).get("requests") or []:
        if isinstance(request.get("exactly"), dict):
            yield request["exactly"]
        yield from (s for s in request.get("firstAvailable") or [] if isinstance(s, dict))


def _claim_spec(new_spec: Json | None, old_spec: Json | None, gates: KubernetesVersion) -> None:
    for gate, name in (("DRADeviceTaints", "tolerations"), ("DRAConsumableCapacity", "capacity")):
        if gates.enabled(gate) or any(name in r for r in _claim_requests(old_spec)):
            continue
        for request in _claim_requests(new_spec):
            request.pop(name, None)


def _allocation_results(claim: Json | None) -> list[Json]:
    allocation = ((claim or {}).get("status") or {}).get("allocation") or {}
    return [r for r in (allocation.get("devices") or {}).get("results") or [] if isinstance(r, dict)]


def _claim_shares(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    """dropDisabledDRAResourceClaimConsumableCapacityStatusFields (resourceclaim/strategy.go): a result's shareID
    and consumedCapacity, and status.devices[].shareID, unless the gate is on or the old claim uses them."""

    def used(o: Json) -> bool:
        return any("shareID" in r or "consumedCapacity" in r for r in _allocation_results(o)) or any(
            "shareID" in d for d in (o.get("status") or {}).get("devices") or [] if isinstance(d, dict)
        )

    if gates.enabled("DRAConsumableCapacity") or _in_use(old, used):
        return
    for result in _allocation_results(new):
        result.pop("shareID", None)
        result.pop("consumedCapacity", None)
    for device in (new.get("status") or {}).get("devices") or []:
        if isinstance(device, dict):
            device.pop("shareID", None)


def _resource_claim(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    _claim_spec(new.get("spec"), (old or {}).get("spec") if old else None, gates)
    _claim_shares(new, old, gates)


def _resource_claim_template(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    def inner(o: Json | None) -> Json | None:
        return ((o or {}).get("spec") or {}).get("spec")

    _claim_spec(inner(new), inner(old) if old else None, gates)


def _pod(new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    # 1.35 names the field workloadRef, 1.36+ schedulingGroup; both sit behind GenericWorkload.
    if gates.enabled("GenericWorkload"):
        return
    old_spec = (old or {}).get("spec") or {}
    for name in ("workloadRef", "schedulingGroup"):
        if name not in old_spec:
            (new.get("spec") or {}).pop(name, None)


_BY_KIND: dict[tuple[str, str], tuple[Callable[[Json, Json | None, KubernetesVersion], None], ...]] = {
    ("resource.k8s.io", "ResourceSlice"): (
        _slice_taints,
        _slice_partitionable,
        _slice_binding_conditions,
        _slice_consumable_capacity,
        _slice_alpha_fields,
    ),
    ("resource.k8s.io", "DeviceClass"): (_device_class,),
    ("resource.k8s.io", "ResourceClaim"): (_resource_claim,),
    ("resource.k8s.io", "ResourceClaimTemplate"): (_resource_claim_template,),
    ("", "Pod"): (_pod,),
}


def drop_disabled_fields(group: str, kind: str, new: Json, old: Json | None, gates: KubernetesVersion) -> None:
    """Remove from `new`, in place, what the version's disabled gates do not let it store."""
    for drop in _BY_KIND.get((group, kind), ()):
        drop(new, old, gates)
