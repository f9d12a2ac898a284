"""A device selector's CEL checked at create, as kube-apiserver's validation compiles it (pkg/apis/resource/
validation validateCELExpression, k8s.io/dynamic-resource-allocation/cel CompileCELExpression): it must parse,
name no variable but `device`, evaluate to a bool, and cost at most CELSelectorExpressionMaxCost (1,000,000) in
the worst case.

The `cel` package neither type-checks nor estimates cost, so two of these are approximations, close enough to
refuse what a user meets (kube-apiserver 1.37 measured: four nested `all` over 10-element lists pass, over 20
do not; `device.driver` alone is "must evaluate to bool ... not string"):
- cost: each macro (all, exists, exists_one, map, filter) costs its range's size times its body's cost plus 3;
  a list or map literal's range is its element count, anything else (a device's attributes or capacity, a list
  attribute) the most a device may have, 32 (ResourceSliceMaxAttributesAndCapacitiesPerDevice); every other
  token costs 1.
- type: the expression is evaluated once against a device with no attributes; a result that is not a bool is
  refused, and one that cannot be computed without attributes (the usual case) is left to the scheduler.
"""

from __future__ import annotations

import re
from typing import Any

import cel

from agent.allocation.cel import MAX_COST

MAX_MAP_ELEMENTS = 32
MACROS = ("all", "exists", "exists_one", "map", "filter")
_MACRO = re.compile(r"\.\s*(all|exists_one|exists|map|filter)\s*\(")
_BOUND = re.compile(r"\.\s*(?:all|exists_one|exists|map|filter)\s*\(\s*([A-Za-z_]\w*)\s*,")
_TOKEN = re.compile(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"|[A-Za-z_]\w*|\d+(?:\.\d+)?|&&|\|\||[=!<>]=|[-+*/%<>!?:]")
_STRING = re.compile(r"'(?:\\.|[^'\\])*'|\"(?:\\.|[^\"\\])*\"")
_CEL_TYPE = {
    bool: "bool",
    int: "int",
    float: "double",
    str: "string",
    bytes: "bytes",
    list: "list(dyn)",
    dict: "map(dyn, dyn)",
    type(None): "null_type",
}


def _blank_strings(text: str) -> str:
    """The expression with string literals' insides blanked, so brackets in them do not count."""
    return _STRING.sub(lambda m: m.group(0)[0] + " " * (len(m.group(0)) - 2) + m.group(0)[-1], text)


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at `start` (or len(text) when unbalanced)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _receiver_start(text: str, end: int) -> int:
    """Start of the operand that ends just before `end` (a `.macro(` call's receiver)."""
    i = end
    while i > 0:
        ch = text[i - 1]
        if ch in ")]}":
            depth = 0
            while i > 0:
                i -= 1
                if text[i] in ")]}":
                    depth += 1
                elif text[i] in "([{":
                    depth -= 1
                    if depth == 0:
                        break
        elif ch.isalnum() or ch in "_.'\" ":
            if ch == " " and not (i > 1 and text[i - 2] == "."):
                break
            i -= 1
        else:
            break
    return i


def _top_level_items(inner: str) -> int:
    if not inner.strip():
        return 0
    depth, count = 0, 1
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            count += 1
    return count


def _range_size(text: str) -> int:
    receiver = text.strip()
    if receiver[:1] in "[{" and _closing(receiver, 0) == len(receiver) - 1:
        return _top_level_items(receiver[1:-1])
    last = list(_MACRO.finditer(receiver))[-1:]
    if last and last[0].group(1) in ("map", "filter") and _closing(receiver, last[0].end() - 1) == len(receiver) - 1:
        return _range_size(receiver[: last[0].start()])  # a list made by map or filter: its source's size
    return MAX_MAP_ELEMENTS


def estimated_cost(expression: str) -> int:
    """The worst-case cost of `expression` (see the module's note), saturating far above the limit."""
    return _cost(_blank_strings(expression))


def _cost(text: str) -> int:
    total, i = 0, 0
    plain: list[str] = []
    while True:
        found = _MACRO.search(text, i)
        if found is None:
            plain.append(text[i:])
            break
        start = _receiver_start(text, found.start())
        close = _closing(text, found.end() - 1)
        plain.append(text[i:start])
        size = _range_size(text[start : found.start()])
        receiver = _cost(text[start : found.start()])
        body = text[found.end() : close].split(",", 1)[-1]
        total += receiver + size * (_cost(body) + 3)
        i = close + 1
        if total > MAX_COST * 1000:
            return total
    return total + sum(len(_TOKEN.findall(part)) for part in plain)


def causes(where: str, expression: str) -> list[tuple[str, str]]:
    """What kube-apiserver says of a selector at `where` (empty when it takes it)."""
    shown = expression if len(expression) <= 200 else expression[:200] + "..."
    try:
        program = cel.compile(expression)
    except Exception as exc:  # the parser's errors are the expression's, whatever their type
        return [(where, f'Invalid value: "{shown}": compilation failed: {exc}')]
    bound = set(_BOUND.findall(expression))
    undeclared = sorted(set(program.variables()) - bound - {"device"})
    if undeclared:
        return [
            (
                where,
                f'Invalid value: "{shown}": compilation failed: ERROR: <input>: undeclared reference to '
                f"'{undeclared[0]}' (in container '')",
            )
        ]
    if estimated_cost(expression) > MAX_COST:
        return [(where, "Forbidden: too complex, exceeds cost limit")]
    result = _probe(program)
    if result is not None and not isinstance(result, bool):
        kind = _CEL_TYPE.get(type(result), type(result).__name__)
        return [(where, f'Invalid value: "{shown}": must evaluate to bool or the unknown type, not {kind}')]
    return []


def _probe(program: Any) -> Any:
    """The expression's value for a device of driver "" with no attributes or capacity; None when it needs some."""
    device = {"driver": "", "attributes": {}, "capacity": {}, "allowMultipleAllocations": False}
    try:
        return program.execute({"device": device})
    except Exception:  # a missing attribute or a function the probe lacks: the type is not known this way
        return None
