"""DRA's CEL environment for device selectors, on the `cel` package (cel-rust bindings).

What kube-scheduler gives a selector (k8s.io/dynamic-resource-allocation/cel): a `device` variable with
`driver`, `attributes['<domain>'].<name>` (int, bool, string or semver) and `capacity['<domain>'].<name>`
(Kubernetes quantities); unprefixed attribute names live in the driver's own domain; an unknown domain is an
empty map; an unknown name is an error. Plus the Kubernetes `quantity` and `semver` libraries.

`cel` cannot carry Python objects, so quantities and versions travel through CEL as one-key maps
({"__quantity__": "<exact value>"}, {"__semver__": "<version>"}) holding a canonical form, which also makes
`==` semantic (quantity('1Gi') == quantity('1024Mi')). Their methods are plain CEL functions, which CEL
also lets us call with method syntax: `device.capacity['d'].memory.compareTo(quantity('40Gi'))`.
Not provided by the `cel` package, hence not here: `cel.bind`, the k8s regex/URL/IP libraries.
Pure: the `cel` package evaluates in memory.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

import cel

from agent import quantity
from agent.jsontypes import Json

QUANTITY = "__quantity__"
SEMVER = "__semver__"

# semver 2.0.0 (semver.org), as k8s' semver() accepts it: no leading "v", no missing parts.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)
# kube-apiserver's limits on a DRA selector (k8s.io/api/resource/v1 types.go): CELSelectorExpressionMaxLength
# = 10 * 1024 characters, checked before compiling; CELSelectorExpressionMaxCost = 1000000 cost units, both the
# worst-case estimate validation allows (pkg/apis/resource/validation: "too complex, exceeds cost limit") and
# the runtime limit (k8s.io/dynamic-resource-allocation/cel compile.go: cel.CostLimit(...)). The `cel` package
# counts no cost; agent.reservation.selector_worker bounds evaluation by time instead (DESIGN.md, issue 17).
MAX_EXPRESSION_LENGTH = 10 * 1024
MAX_COST = 1_000_000
_STRING_LITERAL = re.compile(r"'((?:[^'\\]|\\.)*)'|\"((?:[^\"\\]|\\.)*)\"")


class SelectorError(ValueError):
    """A selector that does not compile, fails on a device, or does not give a bool."""


class MissingAttribute(SelectorError):
    """The selector reads an attribute or capacity the device does not have (and does not guard with has())."""


# --- quantity and semver values -------------------------------------------------------------------------


def quantity_value(text: str) -> Json:
    """A quantity string (e.g. "80Gi", published as capacity) as the CEL value selectors see."""
    try:
        return _quantity(quantity.parse(text))
    except quantity.QuantityError as e:
        raise ValueError(f"{text!r} is not a quantity ({e.reason})") from None


def semver_value(text: str) -> Json:
    """A version string as the CEL value selectors see; build metadata is ignored, as in comparisons."""
    m = _SEMVER.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a semantic version (MAJOR.MINOR.PATCH[-PRE][+BUILD])")
    return {SEMVER: text.split("+", 1)[0]}


def _quantity(value: Fraction) -> Json:
    return {QUANTITY: f"{value.numerator}/{value.denominator}"}


def _is(kind: str, value: object) -> bool:
    return isinstance(value, dict) and set(value) == {kind}


def _fraction(value: object, method: str) -> Fraction:
    if not _is(QUANTITY, value):
        raise TypeError(f"{method}: want a quantity, got {value!r}")
    return Fraction(value[QUANTITY])  # type: ignore[index]


def _semver_key(value: object, method: str) -> tuple[Any, ...]:
    if not _is(SEMVER, value):
        raise TypeError(f"{method}: want a semver, got {value!r}")
    m = _SEMVER.match(value[SEMVER])  # type: ignore[index]
    assert m is not None
    major, minor, patch, pre = int(m[1]), int(m[2]), int(m[3]), m[4]
    # A pre-release sorts before its release; numeric identifiers sort numerically and before alphanumeric ones.
    pre_key = (1,) if pre is None else (0, *((0, int(p), "") if p.isdigit() else (1, 0, p) for p in pre.split(".")))
    return (major, minor, patch, pre_key)


def _compare(a: object, b: object) -> int:
    if _is(SEMVER, a):
        x: Any = _semver_key(a, "compareTo")
        y: Any = _semver_key(b, "compareTo")
    else:
        x, y = _fraction(a, "compareTo"), _fraction(b, "compareTo")
    return int(x > y) - int(x < y)


def _operand(value: object, method: str) -> Fraction:
    return Fraction(value) if isinstance(value, int) and not isinstance(value, bool) else _fraction(value, method)


def _as_integer(q: object) -> int:
    value = _fraction(q, "asInteger")
    if value.denominator != 1 or not -(2**63) <= value.numerator < 2**63:
        raise ValueError(f"asInteger: {value} is not representable as an int64")
    return value.numerator


def _version_part(index: int, name: str) -> Callable[[object], int]:
    return lambda v: int(_semver_key(v, name)[index])


def _accepts(parse: Callable[[str], Json]) -> Callable[[object], bool]:
    def check(text: object) -> bool:
        try:
            parse(str(text))
        except ValueError:
            return False
        return isinstance(text, str)

    return check


FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": quantity_value,
    "isQuantity": _accepts(quantity_value),
    "semver": semver_value,
    "isSemver": _accepts(semver_value),
    "compareTo": _compare,
    "isGreaterThan": lambda a, b: _compare(a, b) > 0,
    "isLessThan": lambda a, b: _compare(a, b) < 0,
    "add": lambda a, b: _quantity(_fraction(a, "add") + _operand(b, "add")),
    "sub": lambda a, b: _quantity(_fraction(a, "sub") - _operand(b, "sub")),
    "asInteger": _as_integer,
    "asApproximateFloat": lambda q: float(_fraction(q, "asApproximateFloat")),
    "isInteger": lambda q: _fraction(q, "isInteger").denominator == 1,
    "sign": lambda q: (_fraction(q, "sign") > 0) - (_fraction(q, "sign") < 0),
    "major": _version_part(0, "major"),
    "minor": _version_part(1, "minor"),
    "patch": _version_part(2, "patch"),
}


# --- the device variable --------------------------------------------------------------------------------


def _attribute(value: Mapping[str, Any]) -> Any:
    """A published DeviceAttribute ({"int": 3}, {"version": "1.2.3"}, ...) as its CEL value."""
    if "version" in value:
        return semver_value(value["version"])
    for kind in ("int", "bool", "string"):
        if kind in value:
            return value[kind]
    raise ValueError(f"attribute {dict(value)!r} has none of int, bool, string, version")


def _by_domain(driver: str, entries: Mapping[str, Any], convert: Callable[[Any], Any]) -> dict[str, dict[str, Any]]:
    domains: dict[str, dict[str, Any]] = {}
    for qualified, value in entries.items():
        domain, _, name = qualified.rpartition("/")
        domains.setdefault(domain or driver, {})[name] = convert(value)
    return domains


def device_variable(driver: str, device: Mapping[str, Any]) -> Json:
    """The CEL `device` for one ResourceSlice device of `driver`."""
    return {
        "driver": driver,
        "attributes": _by_domain(driver, device.get("attributes") or {}, _attribute),
        "capacity": _by_domain(driver, device.get("capacity") or {}, lambda c: quantity_value(str(c["value"]))),
    }


def check_length(expression: str) -> None:
    """SelectorError for a selector longer than kube-apiserver allows: refused before anything compiles it."""
    if len(expression) > MAX_EXPRESSION_LENGTH:
        raise SelectorError(f"selector of {len(expression)} characters: at most {MAX_EXPRESSION_LENGTH} allowed")


class DeviceSelector:
    """One compiled CEL selector expression."""

    def __init__(self, expression: str) -> None:
        self.expression = expression
        check_length(expression)
        try:
            self._program = cel.compile(expression)
        except Exception as e:  # the parser's errors are the caller's input, whatever their type
            raise SelectorError(f"selector {expression!r} does not compile: {e}") from None
        # DRA maps an unknown domain to an empty map; cel maps have no default, so give every domain the
        # expression names (string literals are the only way to name one) an empty map where it has none.
        self._literals = {a or b for a, b in _STRING_LITERAL.findall(expression)}

    def matches(self, device: Mapping[str, Any]) -> bool:
        """Does the selector hold for `device` (from device_variable)? SelectorError when it cannot say."""
        variable = {**device}
        for field in ("attributes", "capacity"):
            variable[field] = {**{key: {} for key in self._literals}, **device[field]}
        context = cel.Context(variables={"device": variable}, functions=FUNCTIONS)
        try:
            result = self._program.execute(context)
        except KeyError as e:
            raise MissingAttribute(f"selector {self.expression!r}: device has no attribute or capacity {e}") from None
        except Exception as e:  # any runtime error (1/0 raises ZeroDivisionError) is the selector's
            raise SelectorError(f"selector {self.expression!r} failed: {e}") from None
        if not isinstance(result, bool):
            raise SelectorError(f"selector {self.expression!r} must give a bool, gave {result!r}")
        return result
