"""The three patch formats the API server accepts: JSON merge, strategic merge and JSON patch.

Strategic merge is implemented for what this project's objects need: maps merge recursively, `null` deletes a
key, lists of objects with a known merge key (resources.MERGE_KEYS, by field name) merge element-wise,
`metadata.finalizers` merges as a union, and every other list is replaced. Directives: `$patch: replace|delete`
on a map or list element and `$deleteFromPrimitiveList/<field>` are honoured; `$setElementOrder/<field>` and
`$retainKeys` are accepted and ignored (element order stays: existing elements first, new ones appended).
"""

from __future__ import annotations

import copy
from typing import Any

from .errors import ApiError
from .resources import MERGE_KEYS, MERGED_PRIMITIVE_LISTS


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            drop = set(value or [])
            out[name] = [v for v in out.get(name) or [] if v not in drop]
            continue
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list):
            out[key] = _merge_list(key, out.get(key), value)
        else:
            merged = strategic_merge_patch(out.get(key), value)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
    return out


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current = current if isinstance(current, list) else []
    if field in MERGED_PRIMITIVE_LISTS:
        return [*current, *(v for v in patch if v not in current)]
    merge_key = MERGE_KEYS.get(field)
    if not merge_key or not all(isinstance(v, dict) for v in patch):
        return list(copy.deepcopy(patch))
    if any(v.get("$patch") == "replace" for v in patch):
        return [copy.deepcopy(v) for v in patch if v.get("$patch") != "replace"]
    out = list(current)
    for element in patch:
        if merge_key not in element:
            raise ApiError(422, f"map in {field} is missing the merge key {merge_key!r}")
        index = next(
            (i for i, v in enumerate(out) if isinstance(v, dict) and v.get(merge_key) == element[merge_key]),
            None,
        )
        if element.get("$patch") == "delete":
            if index is not None:
                del out[index]
        elif index is None:
            out.append(strategic_merge_patch({}, element))
        else:
            out[index] = strategic_merge_patch(out[index], element)
    return out


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _walk(doc: Any, pointer: str) -> tuple[Any, str]:
    """The container holding the pointer's last token, and that token."""
    if not pointer.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {pointer!r}")
    tokens = [_unescape(t) for t in pointer[1:].split("/")]
    cur = doc
    for token in tokens[:-1]:
        if isinstance(cur, dict) and token in cur:
            cur = cur[token]
        elif isinstance(cur, list) and token.isdigit() and int(token) < len(cur):
            cur = cur[int(token)]
        else:
            raise ApiError(422, f"the JSON pointer {pointer!r} does not exist")
    return cur, tokens[-1]


def _get(doc: Any, pointer: str) -> Any:
    if pointer == "":
        return doc
    parent, token = _walk(doc, pointer)
    if isinstance(parent, dict) and token in parent:
        return parent[token]
    if isinstance(parent, list) and token.isdigit() and int(token) < len(parent):
        return parent[int(token)]
    raise ApiError(422, f"the JSON pointer {pointer!r} does not exist")


def _remove(doc: Any, pointer: str) -> Any:
    parent, token = _walk(doc, pointer)
    if isinstance(parent, dict) and token in parent:
        return parent.pop(token)
    if isinstance(parent, list) and token.isdigit() and int(token) < len(parent):
        return parent.pop(int(token))
    raise ApiError(422, f"cannot remove {pointer!r}: it does not exist")


def _add(doc: Any, pointer: str, value: Any) -> Any:
    if pointer == "":
        return value
    parent, token = _walk(doc, pointer)
    if isinstance(parent, dict):
        parent[token] = value
    elif isinstance(parent, list):
        if token == "-":
            parent.append(value)
        elif token.isdigit() and int(token) <= len(parent):
            parent.insert(int(token), value)
        else:
            raise ApiError(422, f"cannot add at {pointer!r}: index out of range")
    else:
        raise ApiError(422, f"cannot add at {pointer!r}: parent is not a container")
    return doc


def json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test; any failing op rejects the whole patch."""
    if not isinstance(ops, list):
        raise ApiError(400, "a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, f"invalid JSON patch operation {op!r}")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise ApiError(400, f"JSON patch {kind} at {path!r} has no value")
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            _remove(doc, path)
        elif kind == "replace":
            _get(doc, path)
            if path == "":
                doc = copy.deepcopy(op["value"])
            else:
                _remove(doc, path)
                doc = _add(doc, path, copy.deepcopy(op["value"]))
        elif kind in ("move", "copy"):
            source = op.get("from")
            if not isinstance(source, str):
                raise ApiError(400, f"JSON patch {kind} at {path!r} has no 'from'")
            value = _remove(doc, source) if kind == "move" else copy.deepcopy(_get(doc, source))
            doc = _add(doc, path, value)
        elif kind == "test":
            if _get(doc, path) != op["value"]:
                raise ApiError(422, f"testing value {path} failed: it is {_get(doc, path)!r}, not {op['value']!r}")
        else:
            raise ApiError(400, f"unknown JSON patch operation {kind!r}")
    return doc
