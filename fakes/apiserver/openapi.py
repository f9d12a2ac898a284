"""OpenAPI documents for the served types, built from the schemas kubernetes-validate ships for the version played.

kubectl reads `/openapi/v3` to decide whether the server validates fields itself (the PATCH operation of a kind
lists the `fieldValidation` query parameter, resource.NewQueryParamVerifierV3) and to find patch strategies for
client-side apply (x-kubernetes-patch-merge-key on the component schemas). `/openapi/v2` serves the same types as
a Swagger 2.0 JSON document for clients that ask for JSON.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from typing import Any

from .resources import ResourceType
from .schemas import definitions

_QUERY = ("dryRun", "fieldManager", "fieldValidation", "pretty")
_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml")
_SMP = "application/strategic-merge-patch+json"


def _convert(schema: Any, prefix: str) -> Any:
    """JSON Schema as kubernetes-validate writes it -> OpenAPI: single types, refs under `prefix`."""
    if isinstance(schema, list):
        return [_convert(s, prefix) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str):
            out[key] = prefix + value.rsplit("/", 1)[-1]
        elif key == "type" and isinstance(value, list):
            kinds = [t for t in value if t != "null"]
            out[key] = kinds[0] if kinds else "object"
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _convert(v, prefix) for name, v in value.items()}
        else:
            out[key] = _convert(value, prefix)
    return out


def _refs(schema: Any) -> set[str]:
    if isinstance(schema, dict):
        found = {schema["$ref"].rsplit("/", 1)[-1]} if isinstance(schema.get("$ref"), str) else set()
        for value in schema.values():
            found |= _refs(value)
        return found
    if isinstance(schema, list):
        return set().union(*map(_refs, schema)) if schema else set()
    return set()


def _closure(version: str, roots: set[str]) -> dict[str, Any]:
    defs = definitions(version)
    seen: dict[str, Any] = {}
    todo = [r for r in roots if r in defs]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = defs[name]
        todo += [r for r in _refs(defs[name]) if r in defs and r not in seen]
    return seen


@functools.cache
def _definition_names(version: str) -> dict[tuple[str, str, str], str]:
    """(group, version, kind) -> the definition of that kind, from x-kubernetes-group-version-kind."""
    out: dict[tuple[str, str, str], str] = {}
    for name, schema in definitions(version).items():
        for gvk in schema.get("x-kubernetes-group-version-kind") or []:
            out[(gvk.get("group", ""), gvk.get("version", ""), gvk.get("kind", ""))] = name
    return out


def definition_name(version: str, rt: ResourceType) -> str | None:
    return _definition_names(version).get((rt.group, rt.version, rt.kind))


def custom_definition_name(rt: ResourceType) -> str:
    """How kube-apiserver names a custom resource's schema: the group reversed, then version and kind."""
    return ".".join([*reversed(rt.group.split(".")), rt.version, rt.kind])


def _custom_schema(rt: ResourceType) -> dict[str, Any]:
    schema: dict[str, Any] = (
        copy.deepcopy(rt.schema) if rt.schema else {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    )
    props: dict[str, Any] = schema.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string"})
    props.setdefault("kind", {"type": "string"})
    props["metadata"] = {"$ref": "#/components/schemas/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"}
    schema["type"] = "object"
    schema["x-kubernetes-group-version-kind"] = [{"group": rt.group, "version": rt.version, "kind": rt.kind}]
    return schema


def _base(rt: ResourceType) -> str:
    return f"/api/{rt.version}" if not rt.group else f"/apis/{rt.group}/{rt.version}"


def _parameters(names: tuple[str, ...]) -> list[dict[str, Any]]:
    return [{"name": n, "in": "query", "schema": {"type": "string"}, "uniqueItems": True} for n in names]


def _operation(
    rt: ResourceType, action: str, op_id: str, ref: str, *, body: tuple[str, ...] = (), query: tuple[str, ...] = ()
) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": ref}}, "application/yaml": {"schema": {"$ref": ref}}}
    op: dict[str, Any] = {
        "operationId": op_id,
        "tags": [rt.group or "core"],
        "parameters": _parameters(query),
        "responses": {"200": {"description": "OK", "content": content}},
        "x-kubernetes-action": action,
        "x-kubernetes-group-version-kind": {"group": rt.group, "version": rt.version, "kind": rt.kind},
    }
    if body:
        op["requestBody"] = {"content": {t: {"schema": {"$ref": ref}} for t in body}, "required": True}
    return op


def _paths(rt: ResourceType, ref: str) -> dict[str, Any]:
    collection = f"{_base(rt)}/{'namespaces/{namespace}/' if rt.namespaced else ''}{rt.plural}"
    item = collection + "/{name}"
    name = rt.kind
    patch_types = (*_PATCH_TYPES, _SMP) if rt.builtin else _PATCH_TYPES
    item_ops = {
        "get": _operation(rt, "get", f"read{name}", ref, query=("pretty",)),
        "put": _operation(rt, "put", f"replace{name}", ref, body=("application/json",), query=_QUERY),
        "patch": _operation(rt, "patch", f"patch{name}", ref, body=patch_types, query=(*_QUERY, "force")),
        "delete": _operation(
            rt, "delete", f"delete{name}", ref, query=("dryRun", "gracePeriodSeconds", "propagationPolicy")
        ),
    }
    out: dict[str, Any] = {
        collection: {
            "get": _operation(
                rt,
                "list",
                f"list{name}",
                ref,
                query=("labelSelector", "fieldSelector", "limit", "watch", "resourceVersion"),
            ),
            "post": _operation(rt, "post", f"create{name}", ref, body=("application/json",), query=_QUERY),
        },
        item: item_ops,
    }
    if rt.has_status:
        out[item + "/status"] = {
            "get": _operation(rt, "get", f"read{name}Status", ref),
            "put": _operation(rt, "put", f"replace{name}Status", ref, body=("application/json",), query=_QUERY),
            "patch": _operation(rt, "patch", f"patch{name}Status", ref, body=patch_types, query=(*_QUERY, "force")),
        }
    return out


def group_version_document(version: str, types: list[ResourceType], title_version: str) -> dict[str, Any]:
    """The OpenAPI 3.0 document of one group-version, as served at /openapi/v3/apis/<group>/<version>."""
    prefix = "#/components/schemas/"
    builtin_roots = {n for t in types if t.builtin and (n := definition_name(version, t))}
    roots = builtin_roots | {
        "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta",
        "io.k8s.apimachinery.pkg.apis.meta.v1.Status",
        "io.k8s.apimachinery.pkg.apis.meta.v1.DeleteOptions",
    }
    schemas = {name: _convert(schema, prefix) for name, schema in _closure(version, roots).items()}
    paths: dict[str, Any] = {}
    for rt in types:
        if rt.builtin:
            name = definition_name(version, rt)
            if name is None:
                continue
        else:
            name = custom_definition_name(rt)
            schemas[name] = _custom_schema(rt)
        paths.update(_paths(rt, prefix + name))
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": title_version},
        "paths": paths,
        "components": {"schemas": schemas},
    }


def document_hash(document: dict[str, Any]) -> str:
    return hashlib.sha512(json.dumps(document, sort_keys=True).encode()).hexdigest().upper()[:128]


def swagger_document(version: str, types: list[ResourceType], title_version: str) -> dict[str, Any]:
    """A Swagger 2.0 document of every served type (JSON, for clients that accept it)."""
    prefix = "#/definitions/"
    roots = {n for t in types if t.builtin and (n := definition_name(version, t))}
    defs = {name: _convert(schema, prefix) for name, schema in _closure(version, roots).items()}
    paths: dict[str, Any] = {}
    for rt in types:
        name = definition_name(version, rt) if rt.builtin else custom_definition_name(rt)
        if name is None:
            continue
        if not rt.builtin:
            defs[name] = json.loads(json.dumps(_custom_schema(rt)).replace("#/components/schemas/", prefix))
        for path, ops in _paths(rt, prefix + name).items():
            paths[path] = {verb: _swagger_operation(op, prefix + name) for verb, op in ops.items()}
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": title_version},
        "paths": paths,
        "definitions": defs,
    }


def _swagger_operation(op: dict[str, Any], ref: str) -> dict[str, Any]:
    out = {k: v for k, v in op.items() if k not in ("requestBody", "responses", "parameters")}
    params = [{"name": p["name"], "in": "query", "type": "string", "uniqueItems": True} for p in op["parameters"]]
    if "requestBody" in op:
        out["consumes"] = list(op["requestBody"]["content"])
        params.append({"name": "body", "in": "body", "required": True, "schema": {"$ref": ref}})
    out["parameters"] = params
    out["produces"] = ["application/json", "application/yaml"]
    out["responses"] = {"200": {"description": "OK", "schema": {"$ref": ref}}}
    return out
