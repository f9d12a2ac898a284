"""The resource types the fake serves: where they live in the URL space and how they behave."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Merge keys the strategic merge patch uses for lists of objects, by field name (the project's types only).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "volumes": "name",
    "conditions": "type",
    "addresses": "type",
    "ownerReferences": "uid",
    "resourceClaims": "name",
    "resourceClaimStatuses": "name",
    "reservedFor": "uid",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
}
# Primitive lists whose strategic merge is a union rather than a replacement.
MERGED_PRIMITIVE_LISTS = frozenset({"finalizers"})


@dataclass(frozen=True)
class ResourceType:
    group: str  # "" is the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    subresources: frozenset[str] = frozenset()
    field_selectors: tuple[str, ...] = ()  # beyond metadata.name and metadata.namespace
    short_names: tuple[str, ...] = ()
    builtin: bool = True  # validated with kubernetes-validate's 1.34 schemas
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)  # a CRD's openAPIV3Schema

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.group, self.version, self.plural)

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    def list_kind(self) -> str:
        return self.kind + "List"

    def discovery(self) -> list[dict[str, Any]]:
        """APIResource entries for this type and its subresources."""
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        main: dict[str, Any] = {
            "name": self.plural,
            "singularName": self.kind.lower(),
            "namespaced": self.namespaced,
            "kind": self.kind,
            "verbs": verbs,
        }
        if self.short_names:
            main["shortNames"] = list(self.short_names)
        out = [main]
        for sub in sorted(self.subresources):
            kind, sub_verbs = {
                "status": (self.kind, ["get", "patch", "update"]),
                "eviction": ("Eviction", ["create"]),
                "binding": ("Binding", ["create"]),
            }[sub]
            out.append(
                {"name": f"{self.plural}/{sub}", "singularName": "", "namespaced": self.namespaced,
                 "kind": kind, "verbs": sub_verbs}
            )
        return out


STATUS = frozenset({"status"})

BUILTIN: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "namespaces", "Namespace", False, STATUS, ("status.phase",), ("ns",)),
    ResourceType("", "v1", "nodes", "Node", False, STATUS, ("spec.unschedulable",), ("no",)),
    ResourceType(
        "", "v1", "pods", "Pod", True, frozenset({"status", "eviction", "binding"}),
        ("spec.nodeName", "status.phase", "spec.schedulerName", "spec.serviceAccountName",
         "spec.restartPolicy", "status.nominatedNodeName"),
        ("po",),
    ),
    ResourceType(
        "", "v1", "events", "Event", True, frozenset(),
        ("involvedObject.kind", "involvedObject.name", "involvedObject.namespace", "involvedObject.uid",
         "reason", "type", "reportingComponent"),
        ("ev",),
    ),
    ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)),
    ResourceType("events.k8s.io", "v1", "events", "Event", True, frozenset(), ("reason", "type"), ("ev",)),
    ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True),
    ResourceType("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False, frozenset(),
                 ("spec.nodeName", "spec.driver")),
    ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, STATUS),
    ResourceType("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True),
    ResourceType("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False),
    ResourceType("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", False,
                 STATUS, short_names=("crd", "crds")),
)


class Registry:
    """Served types by (group, version, plural); custom resources are added at runtime."""

    def __init__(self) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {t.key: t for t in BUILTIN}

    def add(self, rt: ResourceType) -> None:
        self._types[rt.key] = rt

    def remove(self, key: tuple[str, str, str]) -> None:
        self._types.pop(key, None)

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def find(self, what: str) -> ResourceType:
        """A type by kind or plural (case-insensitive), for tests: 'ResourceSlice', 'pods', 'events.k8s.io/Event'."""
        group = None
        if "/" in what:
            group, what = what.rsplit("/", 1)
        matches = [
            t for t in self._types.values()
            if what.lower() in (t.kind.lower(), t.plural) and (group is None or t.group == group)
        ]
        if not matches:
            raise KeyError(f"no served resource type {what!r}")
        # Prefer the core group when a kind is served twice (Event).
        matches.sort(key=lambda t: t.group != "")
        return matches[0]

    def groups(self) -> dict[str, list[str]]:
        """Named groups and their versions (the core group excluded)."""
        out: dict[str, list[str]] = {}
        for t in self._types.values():
            if t.group and t.version not in out.setdefault(t.group, []):
                out[t.group].append(t.version)
        return out
