"""CEL device selectors, evaluated in the shape of DRA's CEL environment.

`device.driver`, `device.attributes['<domain>'].<name>`, `device.capacity['<domain>'].<name>`.
The `cel` package has no Kubernetes quantity type, so this adapter represents quantities as integers
(bytes, counts) and registers `quantity("40Gi")` plus the quantity methods `compareTo`, `isGreaterThan`,
`isLessThan`; with the integer representation plain `>=` also works. Behind the small `SelectorEngine`
interface, so the allocator core can be tested with a stub.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Protocol

import cel

_DECIMAL = {"": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX: dict[str, Fraction] = (
    {k: Fraction(10**e) for k, e in _DECIMAL.items()}
    | {k: Fraction(2**e) for k, e in _BINARY.items()}
    | {"m": Fraction(1, 1000)}
)
_QUANTITY = re.compile(r"^([+-]?[0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|[kMGTPEm]?)$")


class SelectorError(ValueError):
    """A selector that does not compile or cannot be evaluated against a device."""


def parse_quantity(text: str) -> int:
    """A Kubernetes quantity as an integer, rounded up ("40Gi" -> 42949672960, "1500m" -> 2)."""
    m = _QUANTITY.match(text.strip())
    if not m:
        raise SelectorError(f"{text!r} is not a Kubernetes quantity (e.g. 40Gi, 80G, 500m)")
    value = Fraction(m.group(1)) * _SUFFIX[m.group(2)]
    return -((-value.numerator) // value.denominator)


class SelectorEngine(Protocol):
    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        """True when `expression` holds for `device` (a dict shaped like DRA's `device` variable)."""
        ...


def _compare(a: int, b: int) -> int:
    return (a > b) - (a < b)


class CelSelectors:
    """SelectorEngine over the `cel` package; a missing attribute makes the selector false, like DRA."""

    def __init__(self) -> None:
        self._programs: dict[str, Any] = {}

    def _program(self, expression: str) -> Any:
        prog = self._programs.get(expression)
        if prog is None:
            try:
                prog = self._programs[expression] = cel.compile(expression)
            except ValueError as e:
                raise SelectorError(f"selector {expression!r} does not compile: {e}") from e
        return prog

    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        prog = self._program(expression)
        ctx = cel.Context()
        ctx.add_function("quantity", parse_quantity)
        ctx.add_function("compareTo", _compare)
        ctx.add_function("isGreaterThan", lambda a, b: a > b)
        ctx.add_function("isLessThan", lambda a, b: a < b)
        ctx.add_variable("device", dict(device))
        try:
            result = prog.execute(ctx)
        except KeyError:
            return False  # the device lacks the attribute: no match (DRA reports no such key the same way)
        except (RuntimeError, TypeError) as e:
            raise SelectorError(f"selector {expression!r} failed: {e}") from e
        if not isinstance(result, bool):
            raise SelectorError(f"selector {expression!r} must give a bool, gave {result!r}")
        return result
