"""Label and field selectors in the syntax of the `labelSelector` / `fieldSelector` query parameters."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from .errors import ApiError

Matcher = Callable[[dict[str, Any]], bool]
LabelCheck = Callable[[dict[str, str]], bool]


def _equals(key: str, value: str, negate: bool) -> LabelCheck:
    return lambda labels: (labels.get(key) == value) != negate


def _member(key: str, values: set[str], negate: bool) -> LabelCheck:
    return lambda labels: (labels.get(key) in values) != negate


def _exists(key: str, negate: bool) -> LabelCheck:
    return lambda labels: (key in labels) != negate


def _field_equals(path: str, value: str, negate: bool) -> Matcher:
    return lambda obj: (field_value(obj, path) == value) != negate


_SET_OP = re.compile(r"^\s*(!?)\s*([A-Za-z0-9_./-]+)\s*(?:\s(in|notin)\s*\(([^)]*)\))?\s*$")
_EQ_OP = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(==|!=|=)\s*([A-Za-z0-9_.-]*)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses: 'a in (x,y),b' -> ['a in (x,y)', 'b']."""
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return [p for p in parts if p.strip()]


def label_selector(text: str | None) -> Matcher:
    """`=`, `==`, `!=`, `in`, `notin`, `key` (exists) and `!key` (does not exist), ANDed."""
    if not text:
        return lambda obj: True
    checks: list[LabelCheck] = []
    for term in _split_top_level(text):
        eq = _EQ_OP.match(term)
        if eq:
            key, op, value = eq.groups()
            checks.append(_equals(key, value, op == "!="))
            continue
        st = _SET_OP.match(term)
        if not st:
            raise ApiError(400, f"unable to parse requirement: invalid label selector term {term.strip()!r}")
        negate, key, op, values = st.groups()
        if op and negate:
            raise ApiError(400, f"unable to parse requirement: {term.strip()!r}")
        if op:
            allowed = {v.strip() for v in values.split(",") if v.strip()}
            checks.append(_member(key, allowed, op == "notin"))
        else:
            checks.append(_exists(key, bool(negate)))

    return _on_labels(checks)


def selector_matcher(selector: dict[str, Any]) -> Matcher:
    """A metav1.LabelSelector object (`matchLabels`, `matchExpressions` with In, NotIn, Exists, DoesNotExist),
    ANDed, as the query parameter's terms are."""
    checks = [_equals(k, v, False) for k, v in (selector.get("matchLabels") or {}).items()]
    for expr in selector.get("matchExpressions") or []:
        key, op = expr["key"], expr["operator"]
        if op in ("In", "NotIn"):
            checks.append(_member(key, set(expr.get("values") or []), op == "NotIn"))
        else:
            checks.append(_exists(key, {"Exists": False, "DoesNotExist": True}[op]))
    return _on_labels(checks)


def _on_labels(checks: list[LabelCheck]) -> Matcher:
    def match(obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(check(labels) for check in checks)

    return match


def field_value(obj: dict[str, Any], path: str) -> str:
    """The string form a field selector compares against; absent fields compare as ''."""
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if cur is None:
        return ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


def field_selector(text: str | None, supported: tuple[str, ...]) -> Matcher:
    """`field=value`, `field==value`, `field!=value`, ANDed; unsupported fields are a 400 like the real server."""
    if not text:
        return lambda obj: True
    allowed = ("metadata.name", "metadata.namespace", *supported)
    checks: list[Matcher] = []
    for term in _split_top_level(text):
        m = re.match(r"^\s*([A-Za-z0-9_.]+)\s*(==|!=|=)\s*(.*?)\s*$", term)
        if not m:
            raise ApiError(400, f"invalid field selector term {term.strip()!r}")
        path, op, value = m.groups()
        if path not in allowed:
            raise ApiError(400, f"field label not supported: {path}")
        checks.append(_field_equals(path, value, op == "!="))
    return lambda obj: all(check(obj) for check in checks)
