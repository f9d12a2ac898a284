"""Schema validation: the strict schemas kubernetes-validate ships for 1.34-1.37; CRDs' openAPIV3Schema.

kubernetes_validate.validate() re-reads its 1.5 MB definitions file on every call; this module loads the same
files once per version and caches one validator per kind so a write costs milliseconds.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import referencing
from kubernetes_validate import utils as kv

Causes = list[tuple[str, str]]
_lock = threading.Lock()


def _schema_dir(version: str, strict: bool = True) -> str:
    return f"kubernetes-json-schema/v{version}.0-local{'-strict' if strict else ''}"


@functools.cache
def definitions(version: str) -> dict[str, Any]:
    """Every type of the version (non-strict form, x-kubernetes-* extensions kept), by OpenAPI name."""
    return dict(kv.schema_contents(f"{_schema_dir(version, strict=False)}/_definitions.json", version)["$defs"])


@functools.cache
def _registry(version: str) -> referencing.Registry[Any]:
    defs = kv.schema_contents(f"{_schema_dir(version)}/_definitions.json", version)
    return referencing.Resource.from_contents(defs) @ referencing.Registry()


def _file(api_version: str, kind: str) -> str:
    # rbac.authorization.k8s.io/v1 -> rbac-v1, as kubernetes-validate names its files
    short = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{short}.json"


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> jsonschema.protocols.Validator:
    schema = kv.schema_contents(f"{_schema_dir(version)}/{_file(api_version, kind)}", version)
    registry = referencing.Resource.from_contents(schema) @ _registry(version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def has_schema(version: str, api_version: str, kind: str) -> bool:
    try:
        kv.schema_contents(f"{_schema_dir(version)}/{_file(api_version, kind)}", version)
    except Exception:  # kubernetes-validate raises its own error types for a missing file
        return False
    return True


def _path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _unknown(error: jsonschema.ValidationError) -> list[tuple[list[Any], str]]:
    """(container path, key) for each field an additionalProperties error names."""
    if error.validator != "additionalProperties" or not isinstance(error.instance, dict):
        return []
    known = set((error.schema or {}).get("properties") or {})
    return [(list(error.absolute_path), key) for key in error.instance if key not in known]


def _drop(obj: dict[str, Any], container: list[Any], key: str) -> None:
    cur: Any = obj
    for part in container:
        cur = cur[part]
    cur.pop(key, None)


def validate_builtin(obj: dict[str, Any], version: str, field_validation: str = "Strict") -> tuple[Causes, list[str]]:
    """(schema violations, unknown fields) of obj against the official strict schema of its apiVersion and kind.

    With field_validation "Strict" unknown fields are reported and left in place (the caller rejects the write);
    with "Warn" or "Ignore" they are removed from obj, as kube-apiserver's decoder drops them.
    """
    with _lock:  # referencing's lazy resolution is not documented as thread-safe
        validator = _validator(version, obj["apiVersion"], obj["kind"])
        errors = list(validator.iter_errors(obj))
        unknown = [u for e in errors for u in _unknown(e)]
        if unknown and field_validation != "Strict":
            for container, key in sorted(unknown, key=lambda u: -len(u[0])):
                _drop(obj, container, key)
            errors = list(validator.iter_errors(obj))
        errors = [e for e in errors if not (field_validation == "Strict" and _unknown(e))]
        errors.sort(key=lambda e: list(map(str, e.absolute_path)))
        names = [_path([*container, key]) for container, key in unknown]
        return [(_path(e.absolute_path), e.message) for e in errors[:10]], names


def validate_custom(obj: dict[str, Any], schema: dict[str, Any]) -> Causes:
    """Validate against a CRD's structural schema; apiVersion, kind and metadata are the server's business."""
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in ("apiVersion", "kind", "metadata")}
    reduced = {**schema, "properties": props}
    errors = sorted(
        jsonschema.Draft7Validator(_strip_k8s_extensions(reduced)).iter_errors(body),
        key=lambda e: list(map(str, e.absolute_path)),
    )
    return [(_path(e.absolute_path), e.message) for e in errors[:10]]


def prune_custom(obj: Any, schema: Any, at: str = "") -> list[str]:
    """Drop fields a structural schema does not declare, as the apiextensions server prunes them; their paths."""
    if not isinstance(schema, dict) or schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    pruned: list[str] = []
    if isinstance(obj, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key in list(obj):
            where = f"{at}.{key}" if at else key
            if props is not None and key in props:
                pruned += prune_custom(obj[key], props[key], where)
            elif isinstance(extra, dict):
                pruned += prune_custom(obj[key], extra, where)
            elif props is not None and not extra:
                del obj[key]
                pruned.append(where)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            pruned += prune_custom(item, schema["items"], f"{at}[{i}]")
    return pruned


def _strip_k8s_extensions(schema: Any) -> Any:
    """x-kubernetes-* keys carry server behaviour jsonschema does not know; int-or-string widens the type."""
    if isinstance(schema, list):
        return [_strip_k8s_extensions(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strip_k8s_extensions(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
    return out
