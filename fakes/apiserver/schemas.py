"""Schema validation: Kubernetes 1.34 strict schemas shipped by kubernetes-validate; CRDs' openAPIV3Schema.

kubernetes_validate.validate() re-reads its 1.5 MB definitions file on every call; this module loads the same
files once and caches one validator per kind so a write costs milliseconds.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import referencing
from kubernetes_validate import utils as kv

KUBERNETES_VERSION = "1.34"
_SCHEMA_DIR = f"kubernetes-json-schema/v{KUBERNETES_VERSION}.0-local-strict"
_lock = threading.Lock()


@functools.cache
def _registry() -> referencing.Registry[Any]:
    defs = kv.schema_contents(f"{_SCHEMA_DIR}/_definitions.json", KUBERNETES_VERSION)
    return referencing.Resource.from_contents(defs) @ referencing.Registry()


@functools.cache
def _validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    # rbac.authorization.k8s.io/v1 -> rbac-v1, as kubernetes-validate names its files
    short = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kv.schema_contents(f"{_SCHEMA_DIR}/{kind.lower()}-{short}.json", KUBERNETES_VERSION)
    registry = referencing.Resource.from_contents(schema) @ _registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _path(error: jsonschema.ValidationError) -> str:
    out = ""
    for part in error.absolute_path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _errors(validator: jsonschema.protocols.Validator, obj: dict[str, Any]) -> list[tuple[str, str]]:
    errors = sorted(validator.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))
    return [(_path(e), e.message) for e in errors[:10]]


def validate_builtin(obj: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, message) for each violation of the official strict schema of obj's apiVersion and kind."""
    with _lock:  # referencing's lazy resolution is not documented as thread-safe
        validator = _validator(obj["apiVersion"], obj["kind"])
        return _errors(validator, obj)


def validate_custom(obj: dict[str, Any], schema: dict[str, Any]) -> list[tuple[str, str]]:
    """Validate against a CRD's structural schema; apiVersion, kind and metadata are the server's business."""
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    props = {k: v for k, v in (schema.get("properties") or {}).items() if k not in ("apiVersion", "kind", "metadata")}
    reduced = {**schema, "properties": props}
    return _errors(jsonschema.Draft7Validator(_strip_k8s_extensions(reduced)), body)


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
