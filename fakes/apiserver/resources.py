"""The resource types the fake serves: where they live in the URL space and how they behave."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .versions import KubernetesVersion

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
    builtin: bool = True  # validated with kubernetes-validate's schemas of the version played
    schema: dict[str, Any] | None = field(default=None, compare=False, hash=False)  # a CRD's openAPIV3Schema
    # A CRD version's additionalPrinterColumns (server-side Table output).
    columns: tuple[dict[str, Any], ...] = field(default=(), compare=False, hash=False)
    # DELETE answers the deleted object rather than a Status (the store's ReturnDeletedObject).
    returns_deleted: bool = False
    categories: tuple[str, ...] = ()

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
        if self.categories:
            main["categories"] = list(self.categories)
        out = [main]
        for sub in sorted(self.subresources):
            kind, sub_verbs = {
                "status": (self.kind, ["get", "patch", "update"]),
                "eviction": ("Eviction", ["create"]),
                "binding": ("Binding", ["create"]),
            }[sub]
            entry = {
                "name": f"{self.plural}/{sub}",
                "singularName": "",
                "namespaced": self.namespaced,
                "kind": kind,
                "verbs": sub_verbs,
            }
            if sub == "eviction":
                entry.update(group="policy", version="v1")
            out.append(entry)
        return out


STATUS = frozenset({"status"})

# (type, first minor release serving it, feature gate it needs)
_CATALOG: tuple[tuple[ResourceType, int, str | None], ...] = (
    (
        ResourceType(
            "", "v1", "namespaces", "Namespace", False, STATUS, ("status.phase",), ("ns",), returns_deleted=True
        ),
        34,
        None,
    ),
    (ResourceType("", "v1", "nodes", "Node", False, STATUS, ("spec.unschedulable",), ("no",)), 34, None),
    (
        ResourceType(
            "",
            "v1",
            "pods",
            "Pod",
            True,
            frozenset({"status", "eviction", "binding"}),
            (
                "spec.nodeName",
                "status.phase",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.restartPolicy",
                "status.nominatedNodeName",
            ),
            ("po",),
            categories=("all",),
            returns_deleted=True,
        ),
        34,
        None,
    ),
    (
        ResourceType(
            "",
            "v1",
            "events",
            "Event",
            True,
            frozenset(),
            (
                "involvedObject.kind",
                "involvedObject.name",
                "involvedObject.namespace",
                "involvedObject.uid",
                "reason",
                "type",
                "reportingComponent",
            ),
            ("ev",),
        ),
        34,
        None,
    ),
    (ResourceType("", "v1", "configmaps", "ConfigMap", True, short_names=("cm",)), 34, None),
    (ResourceType("", "v1", "secrets", "Secret", True, field_selectors=("type",)), 34, None),
    (ResourceType("", "v1", "serviceaccounts", "ServiceAccount", True, short_names=("sa",)), 34, None),
    (
        ResourceType("apps", "v1", "daemonsets", "DaemonSet", True, STATUS, short_names=("ds",), categories=("all",)),
        34,
        None,
    ),
    (
        ResourceType(
            "apps", "v1", "deployments", "Deployment", True, STATUS, short_names=("deploy",), categories=("all",)
        ),
        34,
        None,
    ),
    (ResourceType("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", False), 34, None),
    (ResourceType("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", False), 34, None),
    (ResourceType("rbac.authorization.k8s.io", "v1", "roles", "Role", True), 34, None),
    (ResourceType("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding", True), 34, None),
    (
        ResourceType(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicies",
            "ValidatingAdmissionPolicy",
            False,
            STATUS,
            categories=("api-extensions",),
        ),
        34,
        None,
    ),
    (
        ResourceType(
            "admissionregistration.k8s.io",
            "v1",
            "validatingadmissionpolicybindings",
            "ValidatingAdmissionPolicyBinding",
            False,
            categories=("api-extensions",),
        ),
        34,
        None,
    ),
    (
        ResourceType(
            "admissionregistration.k8s.io",
            "v1",
            "mutatingadmissionpolicies",
            "MutatingAdmissionPolicy",
            False,
            categories=("api-extensions",),
        ),
        36,
        None,
    ),
    (
        ResourceType(
            "admissionregistration.k8s.io",
            "v1",
            "mutatingadmissionpolicybindings",
            "MutatingAdmissionPolicyBinding",
            False,
            categories=("api-extensions",),
        ),
        36,
        None,
    ),
    (ResourceType("events.k8s.io", "v1", "events", "Event", True, frozenset(), ("reason", "type"), ("ev",)), 34, None),
    (ResourceType("coordination.k8s.io", "v1", "leases", "Lease", True), 34, None),
    (
        ResourceType(
            "resource.k8s.io",
            "v1",
            "resourceslices",
            "ResourceSlice",
            False,
            frozenset(),
            ("spec.nodeName", "spec.driver"),
            returns_deleted=True,
        ),
        34,
        None,
    ),
    (
        ResourceType("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True, STATUS, returns_deleted=True),
        34,
        None,
    ),
    (
        ResourceType(
            "resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True, returns_deleted=True
        ),
        34,
        None,
    ),
    (ResourceType("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False, returns_deleted=True), 34, None),
    # DeviceTaintRule went GA (resource.k8s.io/v1) in 1.37; the fake serves no earlier shape
    (
        ResourceType(
            "resource.k8s.io", "v1", "devicetaintrules", "DeviceTaintRule", False, STATUS, returns_deleted=True
        ),
        37,
        None,
    ),
    (
        ResourceType(
            "apiextensions.k8s.io",
            "v1",
            "customresourcedefinitions",
            "CustomResourceDefinition",
            False,
            STATUS,
            short_names=("crd", "crds"),
            categories=("api-extensions",),
            returns_deleted=True,
        ),
        34,
        None,
    ),
    # The gang API of KEP-4671: v1beta1 from 1.37 (earlier alpha shapes are not served by the fake).
    (ResourceType("scheduling.k8s.io", "v1beta1", "workloads", "Workload", True), 37, "GenericWorkload"),
    (ResourceType("scheduling.k8s.io", "v1beta1", "podgroups", "PodGroup", True, STATUS), 37, "GenericWorkload"),
)


def builtin_types(gates: KubernetesVersion) -> list[ResourceType]:
    """The built-in types a server of this version and these gates serves."""
    return [t for t, since, gate in _CATALOG if gates.minor >= since and (gate is None or gates.enabled(gate))]


class Registry:
    """Served types by (group, version, plural); custom resources are added at runtime."""

    def __init__(self, gates: KubernetesVersion | None = None) -> None:
        self._types: dict[tuple[str, str, str], ResourceType] = {
            t.key: t for t in builtin_types(gates or KubernetesVersion())
        }
        self.generation = 0  # bumped whenever the served types change (CRDs), for caches of derived documents

    def add(self, rt: ResourceType) -> None:
        self._types[rt.key] = rt
        self.generation += 1

    def remove(self, key: tuple[str, str, str]) -> None:
        self._types.pop(key, None)
        self.generation += 1

    def all(self) -> list[ResourceType]:
        return list(self._types.values())

    def find(self, what: str) -> ResourceType:
        """A type by kind or plural (case-insensitive), for tests: 'ResourceSlice', 'pods', 'events.k8s.io/Event'."""
        group = None
        if "/" in what:
            group, what = what.rsplit("/", 1)
        matches = [
            t
            for t in self._types.values()
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
