"""Request semantics: what create, update, patch, delete and the subresources do to stored objects."""

from __future__ import annotations

import copy
import datetime
import json
import random
import re
import uuid
from typing import Any

import yaml

from . import defaults, dra_rules, schemas
from .admission import Admission
from .apply import manager_name, record_update, server_side_apply
from .disabled_fields import drop_disabled_fields
from .errors import ApiError, already_exists, conflict, invalid, not_found
from .patch import json_patch, merge_patch, strategic_merge_patch
from .resources import Registry, ResourceType
from .selectors import field_selector, label_selector
from .store import Store
from .versions import KubernetesVersion

MERGE = "application/merge-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY = "application/apply-patch+yaml"
_GENERATE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
# Kinds whose names are path segments rather than DNS subdomains.
_LOOSE_NAMES = {"ConfigMap", "Event", "Lease"}
_SERVER_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """Everything whose change bumps metadata.generation."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


def _keep(meta: dict[str, Any], key: str, source: dict[str, Any]) -> None:
    if key in source:
        meta[key] = copy.deepcopy(source[key])
    else:
        meta.pop(key, None)


def _same(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Equal but for the times of managedFields entries (an apply that changes nothing is no write)."""

    def untimed(obj: dict[str, Any]) -> Any:
        entries = [{k: v for k, v in e.items() if k != "time"} for e in obj["metadata"].get("managedFields") or []]
        return {**obj, "metadata": {**obj["metadata"], "managedFields": entries}}

    return new == old or untimed(new) == untimed(old)


def success(rt: ResourceType, name: str, uid: str, code: int = 200) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "code": code,
        "details": {"name": name, "group": rt.group, "kind": rt.plural, "uid": uid},
    }


class WriteOptions:
    """Per-request options of a write and what it reports back besides the object."""

    def __init__(
        self,
        field_validation: str = "Warn",
        field_manager: str = "",
        dry_run: bool = False,
        user_agent: str = "",
        force: bool = False,
    ) -> None:
        if field_validation not in ("Strict", "Warn", "Ignore"):
            raise ApiError(400, f"fieldValidation must be Strict, Warn or Ignore, not {field_validation!r}")
        self.field_validation = field_validation
        self.field_manager = field_manager
        self.dry_run = dry_run
        self.user_agent = user_agent
        self.force = force
        self.applied = False  # managedFields were set by server-side apply already
        self.warnings: list[str] = []

    @property
    def manager(self) -> str:
        return manager_name(self.field_manager, self.user_agent)


class Api:
    def __init__(self, registry: Registry, store: Store, gates: KubernetesVersion, *, validate: bool = True) -> None:
        self.registry = registry
        self.store = store
        self.gates = gates
        self.validate = validate
        self.admission = Admission(store.items, self._namespace_labels)

    # Reads.

    def exists(self, rt: ResourceType, namespace: str, name: str) -> bool:
        with self.store.lock:
            return self.store.read(rt.key, namespace, name) is not None

    def get(self, rt: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        with self.store.lock:
            return self._current(rt, namespace, name)

    def list_objects(self, rt: ResourceType, namespace: str | None, query: dict[str, str]) -> dict[str, Any]:
        labels = label_selector(query.get("labelSelector"))
        fields = field_selector(query.get("fieldSelector"), rt.field_selectors)
        with self.store.lock:
            rv = self.store.resource_version
            items = [o for o in self.store.items(rt.key, namespace) if labels(o) and fields(o)]
            items = copy.deepcopy(items)
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        start = 0
        if query.get("continue"):
            try:
                start = int(query["continue"])
            except ValueError:
                raise ApiError(400, "invalid continue token") from None
        limit = int(query.get("limit") or 0)
        if limit > 0:
            if start + limit < len(items):
                meta["continue"] = str(start + limit)
                meta["remainingItemCount"] = len(items) - start - limit
            items = items[start : start + limit]
        elif start:
            items = items[start:]
        return {"kind": rt.list_kind(), "apiVersion": rt.api_version, "metadata": meta, "items": items}

    # Writes.

    def create(
        self, rt: ResourceType, namespace: str, body: Any, options: WriteOptions | None = None
    ) -> dict[str, Any]:
        options = options or WriteOptions()
        obj = self._body(rt, namespace, body)
        meta = obj["metadata"]
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise invalid(rt.group, rt.kind, "", [("metadata.name", "name or generateName is required")])
            meta["name"] = meta["generateName"] + "".join(random.choices(_GENERATE_ALPHABET, k=5))
        for field in (*_SERVER_META, "resourceVersion"):
            meta.pop(field, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1)
        if rt.kind == "Pod":
            obj["status"] = {"phase": "Pending"}
        elif rt.has_status and rt.kind not in ("Node", "Namespace"):
            obj.pop("status", None)  # status is written through the status subresource only
        if rt.kind == "Namespace":
            obj["status"] = {"phase": "Active"}
        with self.store.lock:
            if rt.namespaced:
                self._namespace_accepts(namespace)
            if self.store.read(rt.key, namespace, meta["name"]) is not None:
                raise already_exists(rt.group, rt.plural, meta["name"])
            self._admit(rt, obj, None, options)
            if not options.applied:
                record_update(None, obj, options.manager, now())
            if options.dry_run:
                return obj
            created = self.store.write(rt.key, obj, None)
        if rt.kind == "CustomResourceDefinition":
            created = self._established(created)
        return created

    def update(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        body: Any,
        subresource: str = "",
        options: WriteOptions | None = None,
    ) -> dict[str, Any]:
        with self.store.lock:
            old = self._current(rt, namespace, name)
            obj = self._body(rt, namespace, body)
            if obj["metadata"].get("name", name) != name:
                raise ApiError(
                    400,
                    f"the name of the object ({obj['metadata'].get('name')}) does not match the "
                    f"name on the URL ({name})",
                )
            return self._replace(rt, old, obj, subresource, options or WriteOptions())

    def patch(
        self,
        rt: ResourceType,
        namespace: str,
        name: str,
        content_type: str,
        body: Any,
        subresource: str = "",
        options: WriteOptions | None = None,
    ) -> dict[str, Any]:
        options = options or WriteOptions()
        if content_type == APPLY:
            return self.apply(rt, namespace, name, body, subresource, options)
        if content_type not in (JSON_PATCH, MERGE, STRATEGIC):  # refused before the object is looked up
            raise ApiError(415, "415: Unsupported Media Type", details={})
        with self.store.lock:
            old = self._current(rt, namespace, name)
            if content_type == JSON_PATCH:
                patched = json_patch(old, body)
            elif content_type == MERGE:
                patched = merge_patch(old, body)
            elif content_type == STRATEGIC:
                if not rt.builtin:
                    raise ApiError(
                        415,
                        f"the body of the request was in an unknown format - accepted media types "
                        f"include: {JSON_PATCH}, {MERGE}, application/apply-patch+yaml",
                    )
                patched = strategic_merge_patch(old, body)
            if not isinstance(patched, dict):
                raise ApiError(422, "the patch did not produce an object")
            patched.setdefault("metadata", {})
            if patched["metadata"].get("resourceVersion") in (None, ""):
                patched["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
            return self._replace(rt, old, patched, subresource, options)

    def apply(
        self, rt: ResourceType, namespace: str, name: str, config: Any, subresource: str, options: WriteOptions
    ) -> dict[str, Any]:
        """Server-side apply; it creates the object when there is none."""
        if not isinstance(config, dict) or not config.get("apiVersion") or not config.get("kind"):
            raise ApiError(400, "an applied configuration must be an object with apiVersion and kind")
        config = self._body(rt, namespace, config)
        if config["metadata"].get("name") not in (None, name):
            raise ApiError(
                400,
                f"the name of the object ({config['metadata']['name']}) does not match the name on the URL ({name})",
            )
        config["metadata"]["name"] = name
        options.applied = True
        with self.store.lock:
            live = self.store.read(rt.key, namespace, name)
            if live is None:
                if subresource:
                    raise not_found(rt.group, rt.plural, name)
                merged = server_side_apply(None, config, options.field_manager, options.force, now())
                return self.create(rt, namespace, merged, options)
            merged = server_side_apply(
                copy.deepcopy(live), config, options.field_manager, options.force, now(), subresource
            )
            merged["metadata"]["resourceVersion"] = (
                config["metadata"].get("resourceVersion") or live["metadata"]["resourceVersion"]
            )
            return self._replace(rt, copy.deepcopy(live), merged, subresource, options)

    def delete(self, rt: ResourceType, namespace: str, name: str, options: dict[str, Any] | None) -> dict[str, Any]:
        options = options or {}
        with self.store.lock:
            old = self._current(rt, namespace, name)
            pre = options.get("preconditions") or {}
            if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
                raise conflict(
                    rt.group,
                    rt.plural,
                    name,
                    f"Precondition failed: UID in precondition: {pre['uid']}, "
                    f"UID in object meta: {old['metadata']['uid']}",
                )
            if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]:
                raise conflict(rt.group, rt.plural, name, "Precondition failed: resourceVersion mismatch")
            orphan = options.get("propagationPolicy") == "Orphan" or options.get("orphanDependents") is True
            if old["metadata"].get("finalizers"):
                if old["metadata"].get("deletionTimestamp"):
                    return copy.deepcopy(old)
                obj = copy.deepcopy(old)
                obj["metadata"]["deletionTimestamp"] = now()
                obj["metadata"]["deletionGracePeriodSeconds"] = 0
                return self.store.write(rt.key, obj, old)
            gone = self._remove(rt, old, orphan)
        if rt.returns_deleted or not rt.builtin:
            return gone
        return success(rt, name, old["metadata"]["uid"])

    def evict(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        """pods/eviction: no PodDisruptionBudgets are served, so every eviction is allowed and deletes the pod."""
        pods = self.registry.find("pods")
        if not isinstance(body, dict) or body.get("kind") not in (None, "Eviction"):
            raise ApiError(400, "the body of an eviction must be a policy/v1 Eviction")
        body = {"apiVersion": "policy/v1", "kind": "Eviction", **body}
        body.setdefault("metadata", {}).setdefault("name", name)
        causes, unknown = schemas.validate_builtin(body, self.gates.version)
        causes += [(f, "unknown field") for f in unknown]
        if causes:
            raise invalid("policy", body["kind"], body["metadata"]["name"], causes)
        self.delete(pods, namespace, name, body.get("deleteOptions"))
        return success(pods, name, "", 201)

    def bind(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        """pods/binding: sets spec.nodeName once, like the scheduler's bind call."""
        pods = self.registry.find("pods")
        target = ((body or {}).get("target") or {}).get("name") if isinstance(body, dict) else None
        if not target:
            raise invalid("", "Binding", name, [("target.name", "required")])
        with self.store.lock:
            old = self._current(pods, namespace, name)
            if old.get("spec", {}).get("nodeName"):
                raise conflict("", "pods", name, f"pod {name} is already assigned to node {old['spec']['nodeName']!r}")
            obj = copy.deepcopy(old)
            obj["spec"]["nodeName"] = target
            self.store.write(pods.key, obj, old)
        return success(pods, name, old["metadata"]["uid"], 201)

    # Internals.

    def _current(self, rt: ResourceType, namespace: str, name: str) -> dict[str, Any]:
        found = self.store.read(rt.key, namespace, name)
        if found is None:
            raise not_found(rt.group, rt.plural, name)
        return copy.deepcopy(found)

    def _body(self, rt: ResourceType, namespace: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a {rt.kind} object")
        obj = copy.deepcopy(body)
        for field, want in (("apiVersion", rt.api_version), ("kind", rt.kind)):
            if obj.get(field) in (None, ""):
                obj[field] = want
            elif obj[field] != want:
                raise ApiError(
                    400,
                    f"the API version in the data ({obj.get('apiVersion')}) and kind "
                    f"({obj.get('kind')}) do not match the URL ({rt.api_version}, {rt.kind})",
                )
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise ApiError(400, "metadata must be an object")
        if rt.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise ApiError(
                    400, "the namespace of the provided object does not match the namespace sent on the request"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        return obj

    def _replace(
        self, rt: ResourceType, old: dict[str, Any], obj: dict[str, Any], subresource: str, options: WriteOptions
    ) -> dict[str, Any]:
        name = old["metadata"]["name"]
        wanted_rv = obj["metadata"].get("resourceVersion")
        if wanted_rv not in (None, "") and wanted_rv != old["metadata"]["resourceVersion"]:
            raise conflict(
                rt.group,
                rt.plural,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if subresource == "status":
            new = copy.deepcopy(old)
            if "status" in obj:
                new["status"] = obj["status"]
            else:
                new.pop("status", None)
            if options.applied:
                new["metadata"]["managedFields"] = obj["metadata"].get("managedFields")
        else:
            new = obj
            for field in (*_SERVER_META, "namespace", "name"):
                if field in old["metadata"]:
                    new["metadata"][field] = old["metadata"][field]
                else:
                    new["metadata"].pop(field, None)
            if rt.has_status:
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            if _spec_part(new) != _spec_part(old):
                new["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if not options.applied and new["metadata"].get("managedFields") != []:
            _keep(new["metadata"], "managedFields", old["metadata"])  # clients' copies never change ownership
        if _same(new, old):
            return old  # a no-op write keeps its resourceVersion, like the real server
        if old["metadata"].get("deletionTimestamp"):
            added = set(new["metadata"].get("finalizers") or []) - set(old["metadata"].get("finalizers") or [])
            if added:
                why = f"no new finalizers can be added if the object is being deleted, found {sorted(added)}"
                raise invalid(rt.group, rt.kind, name, [("metadata.finalizers", why)])
        self._admit(rt, new, old, options, subresource)
        if _same(new, old):
            return old  # what was dropped on admission may turn the write into a no-op
        if not options.applied:
            record_update(old, new, options.manager, now(), subresource)
        if options.dry_run:
            return new
        if old["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            return self._remove(rt, new, orphan=False)
        return self.store.write(rt.key, new, old)

    def _namespace_accepts(self, namespace: str) -> None:
        """The NamespaceLifecycle admission plugin: no new objects in a namespace that is missing or going."""
        found = self.store.read(self.registry.find("Namespace").key, "", namespace)
        if found is None:
            raise not_found("", "namespaces", namespace)
        if found["metadata"].get("deletionTimestamp"):
            raise ApiError(
                403,
                f"unable to create new content in namespace {namespace} because it is being terminated",
                reason="Forbidden",
            )

    def _remove(self, rt: ResourceType, obj: dict[str, Any], orphan: bool) -> dict[str, Any]:
        if rt.kind == "Namespace" and not rt.group:
            self._empty_namespace(obj["metadata"]["name"])
        gone = self.store.remove(rt.key, obj)
        if rt.kind == "CustomResourceDefinition":
            self._unregister_crd(obj)
        if not orphan:
            self._collect_dependents(obj["metadata"]["uid"])
        return gone

    def _empty_namespace(self, namespace: str) -> None:
        """What the namespace controller does before a namespace goes: delete everything in it."""
        for rt in self.registry.all():
            if rt.namespaced:
                for obj in list(self.store.items(rt.key, namespace)):
                    self.delete(rt, namespace, obj["metadata"]["name"], None)

    def _collect_dependents(self, owner_uid: str) -> None:
        """Background garbage collection: delete every object that names the removed one as its owner."""
        for rt in self.registry.all():
            for dependent in list(self.store.items(rt.key)):
                refs = dependent["metadata"].get("ownerReferences") or []
                if any(ref.get("uid") == owner_uid for ref in refs):
                    meta = dependent["metadata"]
                    self.delete(rt, meta.get("namespace", ""), meta["name"], None)

    # Validation.

    def _namespace_labels(self, namespace: str) -> dict[str, str] | None:
        found = self.store.read(("", "v1", "namespaces"), "", namespace)
        return dict((found or {}).get("metadata", {}).get("labels") or {}) if found is not None else None

    def _admit(
        self,
        rt: ResourceType,
        obj: dict[str, Any],
        old: dict[str, Any] | None,
        options: WriteOptions,
        subresource: str = "",
    ) -> None:
        """Decode (unknown fields per fieldValidation), drop what disabled gates hide, default, run the mutating
        admission policies, validate, run the validating admission policies."""
        drop_disabled_fields(rt.group, rt.kind, obj, old, self.gates)
        if rt.group == "resource.k8s.io" and rt.builtin:
            defaults.apply(rt.kind, obj)
        if rt.group == "admissionregistration.k8s.io" and rt.kind in defaults.POLICY_KINDS:
            defaults.admission_policy(obj)
        operation = "CREATE" if old is None else "UPDATE"
        namespace = obj["metadata"].get("namespace", "")
        mutated = self.admission.mutate(rt, operation, subresource, obj, old, namespace)
        if mutated is not obj:
            obj.clear()
            obj.update(mutated)
        if not self.validate:
            return
        self._validate(rt, obj, old, options)
        self.admission.validate(rt, operation, subresource, obj, old, namespace, options.warnings)

    def _validate(
        self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None, options: WriteOptions
    ) -> None:
        causes = self._meta_causes(rt, obj["metadata"])
        unknown: list[str] = []
        if rt.builtin:
            found, unknown = schemas.validate_builtin(obj, self.gates.version, options.field_validation)
            causes += found
        elif rt.schema is not None:
            body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
            unknown = schemas.prune_custom(body, rt.schema)
            if options.field_validation != "Strict":
                obj.update(body)
                for gone in [k for k in obj if k not in body and k not in ("apiVersion", "kind", "metadata")]:
                    del obj[gone]
            causes += schemas.validate_custom(obj, rt.schema)
        if unknown and options.field_validation == "Strict":
            what = ", ".join(f'unknown field "{f}"' for f in unknown)
            raise ApiError(
                400,
                f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: strict decoding error: {what}',
            )
        if options.field_validation == "Warn":
            options.warnings += [f'unknown field "{f}"' for f in unknown]
        if rt.group == "resource.k8s.io":
            causes += dra_rules.validate_resource_object(rt.kind, obj, old, self.gates.minor)
        if rt.kind == "CustomResourceDefinition":
            causes += self._crd_causes(obj, old)
        if causes:
            raise invalid(rt.group, rt.kind, obj["metadata"].get("name", ""), causes)

    def _meta_causes(self, rt: ResourceType, meta: dict[str, Any]) -> list[tuple[str, str]]:
        causes: list[tuple[str, str]] = []
        name = meta.get("name")
        if rt.kind == "Namespace":
            why = dra_rules.dns_label(name)
        elif rt.kind in _LOOSE_NAMES or not rt.builtin:
            ok = isinstance(name, str) and name not in (".", "..") and not re.search(r"[/%]", name)
            why = None if ok else "may not be '.' or '..' and may not contain '/' or '%'"
        else:
            why = dra_rules.dns_subdomain(name)
        if why:
            causes.append(("metadata.name", why))
        for key, value in (meta.get("labels") or {}).items():
            prefix, _, label = str(key).rpartition("/")
            if (
                (prefix and dra_rules.dns_subdomain(prefix))
                or not label
                or len(label) > 63
                or not _LABEL_NAME.match(label)
            ):
                causes.append(
                    (
                        f"metadata.labels[{key}]",
                        "must be a qualified name (prefix/name, name at most 63 alphanumeric, '-', '_' or '.')",
                    )
                )
            if not isinstance(value, str) or len(value) > 63 or not _LABEL_NAME.match(value):
                causes.append(
                    (
                        f"metadata.labels[{key}]",
                        f"invalid label value {value!r}: at most 63 alphanumeric, "
                        "'-', '_' or '.', starting and ending alphanumeric",
                    )
                )
        return causes

    # Custom resources.

    def register_custom(
        self,
        group: str,
        version: str,
        plural: str,
        kind: str,
        namespaced: bool,
        schema: dict[str, Any] | None = None,
        status: bool = True,
        columns: tuple[dict[str, Any], ...] = (),
        short_names: tuple[str, ...] = (),
        categories: tuple[str, ...] = (),
    ) -> ResourceType:
        rt = ResourceType(
            group,
            version,
            plural,
            kind,
            namespaced,
            frozenset({"status"}) if status else frozenset(),
            short_names=short_names,
            builtin=False,
            schema=schema,
            columns=columns,
            returns_deleted=True,
            categories=categories,
        )
        self.registry.add(rt)
        return rt

    def _crd_causes(self, obj: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str]]:
        spec = obj.get("spec") or {}
        names = spec.get("names") or {}
        want = f"{names.get('plural')}.{spec.get('group')}"
        causes = []
        if obj["metadata"]["name"] != want:
            causes.append(("metadata.name", f'must be spec.names.plural+"."+spec.group ({want!r})'))
        if sum(1 for v in spec.get("versions") or [] if v.get("storage")) != 1:
            causes.append(("spec.versions", "exactly one version must be the storage version"))
        return causes

    def _established(self, crd: dict[str, Any]) -> dict[str, Any]:
        """Serve the CRD's versions and mark it Established, as the real server does within moments."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec.get("versions") or []:
            if version.get("served", True):
                schema = (version.get("schema") or {}).get("openAPIV3Schema")
                self.register_custom(
                    spec["group"],
                    version["name"],
                    names["plural"],
                    names["kind"],
                    spec.get("scope", "Namespaced") == "Namespaced",
                    schema,
                    "status" in (version.get("subresources") or {}),
                    tuple(version.get("additionalPrinterColumns") or ()),
                    tuple(names.get("shortNames") or ()),
                    tuple(names.get("categories") or ()),
                )
        with self.store.lock:
            old = self._current(self.registry.find("CustomResourceDefinition"), "", crd["metadata"]["name"])
            new = copy.deepcopy(old)
            stamp = now()
            new["status"] = {
                "acceptedNames": names,
                "storedVersions": [v["name"] for v in spec.get("versions") or [] if v.get("storage")],
                "conditions": [
                    {"type": t, "status": "True", "reason": r, "message": "", "lastTransitionTime": stamp}
                    for t, r in (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))
                ],
            }
            return self.store.write(self.registry.find("CustomResourceDefinition").key, new, old)

    def _unregister_crd(self, crd: dict[str, Any]) -> None:
        spec = crd.get("spec") or {}
        for version in spec.get("versions") or []:
            key = (spec.get("group", ""), version.get("name", ""), (spec.get("names") or {}).get("plural", ""))
            self.store.drop_type(key)
            self.registry.remove(key)


def parse_yaml(raw: bytes) -> Any:
    """An apply-patch+yaml body (YAML, or JSON, which YAML includes)."""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ApiError(400, f"the request body is not valid YAML: {exc}") from None


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw or b"null")
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
