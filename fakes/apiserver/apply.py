"""Field ownership (metadata.managedFields) and server-side apply (PATCH application/apply-patch+yaml).

A simplified structured-merge-diff: fields are leaf paths; maps merge key by key; lists whose field has a merge key
(resources.MERGE_KEYS) are associative, keyed `k:{"<key>":<value>}`; `finalizers` is a set (`v:<value>`); every
other list is atomic, owned and replaced whole. What it does, as kube-apiserver does:
- Every write records its manager (the fieldManager parameter, else the User-Agent's product name) with the fields
  it set; an Update takes the fields it changed away from other managers.
- Apply merges the applied configuration into the object, removes fields this manager applied before and no
  longer applies (unless another manager owns them), and answers 409 with one FieldManagerConflict cause per field
  another manager owns with a different value, unless force=true, which takes those fields over.
Simplified: ownership is by leaf field only (no `.` entries for whole list elements), the list-map keys are those
of MERGE_KEYS rather than each field's x-kubernetes-list-map-keys, and custom resources' lists are atomic.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from agent.jsontypes import Json

from .errors import ApiError
from .resources import MERGE_KEYS, MERGED_PRIMITIVE_LISTS

Path = tuple[str, ...]
_TRACKED_META = ("labels", "annotations", "finalizers", "ownerReferences")


def _element_key(field: str, item: Any) -> str | None:
    key = MERGE_KEYS.get(field)
    if key and isinstance(item, dict) and key in item:
        return "k:" + json.dumps({key: item[key]}, separators=(",", ":"))
    return None


def _associative(field: str, value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_element_key(field, i) for i in value)


def _leaves(value: Any, field: str, prefix: Path, out: dict[Path, Any]) -> None:
    if isinstance(value, dict) and value:
        for key, child in value.items():
            _leaves(child, key, (*prefix, f"f:{key}"), out)
    elif _associative(field, value):
        for item in value:
            key = _element_key(field, item)
            assert key is not None
            _leaves(item, field, (*prefix, key), out)
    elif field in MERGED_PRIMITIVE_LISTS and isinstance(value, list):
        for item in value:
            out[(*prefix, "v:" + json.dumps(item, separators=(",", ":")))] = item
    else:
        out[prefix] = value


def leaves(obj: Json) -> dict[Path, Any]:
    """Every owned leaf field of an object and its value (apiVersion, kind and server metadata excluded)."""
    out: dict[Path, Any] = {}
    for key, value in obj.items():
        if key in ("apiVersion", "kind"):
            continue
        if key == "metadata":
            for meta_key in _TRACKED_META:
                if meta_key in (value or {}):
                    _leaves(value[meta_key], meta_key, ("f:metadata", f"f:{meta_key}"), out)
            continue
        _leaves(value, key, (f"f:{key}",), out)
    return out


def fields_v1(paths: set[Path] | list[Path]) -> Json:
    tree: Json = {}
    for path in paths:
        node = tree
        for part in path:
            node = node.setdefault(part, {})
    return tree


def _paths_of(tree: Json, prefix: Path = ()) -> set[Path]:
    out: set[Path] = set()
    for key, child in tree.items():
        if key == ".":
            continue
        if isinstance(child, dict) and any(k != "." for k in child):
            out |= _paths_of(child, (*prefix, key))
        else:
            out.add((*prefix, key))
    return out


def manager_name(field_manager: str, user_agent: str) -> str:
    """The fieldManager parameter, else the User-Agent up to its first '/', as kube-apiserver derives it."""
    if field_manager:
        if len(field_manager) > 128:
            raise ApiError(422, "fieldManager must be at most 128 characters")
        return field_manager
    return (user_agent.split("/", 1)[0] or "unknown")[:128]


def _entry(manager: str, operation: str, api_version: str, paths: set[Path], stamp: str, subresource: str) -> Json:
    entry: Json = {
        "manager": manager,
        "operation": operation,
        "apiVersion": api_version,
        "time": stamp,
        "fieldsType": "FieldsV1",
        "fieldsV1": fields_v1(paths),
    }
    if subresource:
        entry["subresource"] = subresource
    return entry


def _owned(entries: list[Json]) -> list[tuple[Json, set[Path]]]:
    return [(e, _paths_of(e.get("fieldsV1") or {})) for e in entries]


def _identity(entry: Json) -> tuple[Any, Any, Any]:
    return entry.get("manager"), entry.get("operation"), entry.get("subresource", "")


def _store(entries: list[tuple[Json, set[Path]]], mine: Json | None) -> list[Json]:
    """Entries that still own something, each with its remaining fields; this write's entry takes the place of the
    manager's earlier one (or goes last)."""
    out: list[Json] = []
    placed = False
    for entry, paths in entries:
        if mine is not None and _identity(entry) == _identity(mine):
            if not placed:
                out.append(mine)
                placed = True
        elif paths:
            out.append({**entry, "fieldsV1": fields_v1(paths)})
    if mine is not None and not placed:
        out.append(mine)
    return out


def record_update(old: Json | None, new: Json, manager: str, stamp: str, subresource: str = "") -> None:
    """Set new's managedFields after a create/update/patch by `manager` (operation Update): it owns what it changed,
    and nobody owns fields that are gone."""
    meta = new.setdefault("metadata", {})
    if meta.get("managedFields") == [] and old is not None:  # an explicit empty list resets ownership
        meta.pop("managedFields")
        return
    before = leaves(old) if old is not None else {}
    after = leaves(new)
    changed = {p for p, v in after.items() if before.get(p, _MISSING) != v}
    owned = _owned(copy.deepcopy((old or {}).get("metadata", {}).get("managedFields") or []))
    mine_paths = set(changed)
    for entry, paths in owned:
        paths.difference_update(changed)
        paths.intersection_update(after)
        if (
            entry.get("manager") == manager
            and entry.get("operation") == "Update"
            and entry.get("subresource", "") == subresource
        ):
            mine_paths |= paths
            paths.clear()
    mine = _entry(manager, "Update", new.get("apiVersion", ""), mine_paths, stamp, subresource) if mine_paths else None
    entries = _store(owned, mine)
    if entries:
        meta["managedFields"] = entries
    else:
        meta.pop("managedFields", None)


_MISSING = object()


def _get(obj: Any, path: Path) -> Any:
    for part in path:
        if part.startswith("f:"):
            obj = obj.get(part[2:], _MISSING) if isinstance(obj, dict) else _MISSING
        elif part.startswith("k:"):
            want = json.loads(part[2:])
            obj = (
                next((i for i in obj if isinstance(i, dict) and all(i.get(k) == v for k, v in want.items())), _MISSING)
                if isinstance(obj, list)
                else _MISSING
            )
        elif part.startswith("v:"):
            value = json.loads(part[2:])
            obj = value if isinstance(obj, list) and value in obj else _MISSING
        if obj is _MISSING:
            return _MISSING
    return obj


def _remove(obj: Any, path: Path) -> None:
    """Remove one leaf, then containers it left empty."""
    if not path or not isinstance(obj, dict | list):
        return
    head, rest = path[0], path[1:]
    if head.startswith("f:") and isinstance(obj, dict):
        key = head[2:]
        if key not in obj:
            return
        if rest:
            _remove(obj[key], rest)
            if obj[key] in ({}, []):
                del obj[key]
        else:
            del obj[key]
    elif head.startswith("k:") and isinstance(obj, list):
        want = json.loads(head[2:])
        for i, item in enumerate(obj):
            if isinstance(item, dict) and all(item.get(k) == v for k, v in want.items()):
                if rest:
                    _remove(item, rest)
                if not rest or not item or set(item) <= set(want):
                    del obj[i]
                return
    elif head.startswith("v:") and isinstance(obj, list):
        value = json.loads(head[2:])
        if value in obj:
            obj.remove(value)


def _merge(live: Any, config: Any, field: str) -> Any:
    if isinstance(live, dict) and isinstance(config, dict):
        out = dict(live)
        for key, value in config.items():
            out[key] = _merge(live.get(key, _MISSING), value, key)
        return out
    if _associative(field, config) and isinstance(live, list):
        out_list = list(live)
        for item in config:
            key = _element_key(field, item)
            index = next((i for i, cur in enumerate(out_list) if _element_key(field, cur) == key), None)
            if index is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[index] = _merge(out_list[index], item, field)
        return out_list
    if field in MERGED_PRIMITIVE_LISTS and isinstance(config, list) and isinstance(live, list):
        return [*live, *(v for v in config if v not in live)]
    return copy.deepcopy(config)


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += "." + part[2:] if part.startswith("f:") else f"[{part[2:]}]"
    return out


def server_side_apply(
    live: Json | None, config: Json, manager: str, force: bool, stamp: str, subresource: str = ""
) -> Json:
    """The object after `manager` applies `config` to `live` (None: apply creates it)."""
    if not manager:
        raise ApiError(
            400,
            "PATCH requests with apply-patch content type must set fieldManager "
            "(fieldManager is required for apply requests)",
        )
    applied = leaves(config)
    base = copy.deepcopy(live) if live is not None else {}
    entries = _owned(copy.deepcopy((base.get("metadata") or {}).get("managedFields") or []))
    mine_before: set[Path] = set()
    conflicts: list[tuple[Path, Json]] = []
    for entry, paths in entries:
        same = (
            entry.get("manager") == manager
            and entry.get("operation") == "Apply"
            and entry.get("subresource", "") == subresource
        )
        if same:
            mine_before |= paths
            continue
        for path in paths & set(applied):
            if _get(base, path) != applied[path]:
                conflicts.append((path, entry))
    if conflicts and not force:
        causes = [
            {
                "reason": "FieldManagerConflict",
                "field": _dotted(p),
                "message": f'conflict with "{e.get("manager")}"'
                + (f" using {e['apiVersion']}" if e.get("apiVersion") else ""),
            }
            for p, e in conflicts
        ]
        if len(causes) == 1:
            text = f"Apply failed with 1 conflict: {causes[0]['message']}: {causes[0]['field']}"
        else:
            lines = "\n".join(f"- {c['message']}: {c['field']}" for c in causes)
            text = f"Apply failed with {len(causes)} conflicts: {lines}"
        raise ApiError(409, text, reason="Conflict", details={"causes": causes})
    taken = {p for p, _ in conflicts}
    others: set[Path] = set()
    for entry, paths in entries:
        if (
            entry.get("manager") == manager
            and entry.get("operation") == "Apply"
            and entry.get("subresource", "") == subresource
        ):
            paths.clear()
        else:
            paths.difference_update(taken)
            others |= paths
    merged: Json = _merge(base, {k: v for k, v in config.items() if k != "metadata"}, "")
    meta = dict(base.get("metadata") or {})
    for key, value in (config.get("metadata") or {}).items():
        if key in ("managedFields", "resourceVersion", "uid", "creationTimestamp", "generation"):
            continue
        meta[key] = _merge(meta.get(key, _MISSING), value, key)
    merged["metadata"] = meta
    for path in sorted(mine_before - set(applied) - others, key=len, reverse=True):
        _remove(merged, path)
    mine = _entry(manager, "Apply", config.get("apiVersion", ""), set(applied), stamp, subresource)
    merged["metadata"]["managedFields"] = _store(entries, mine)
    return merged
