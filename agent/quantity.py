"""Kubernetes resource quantities ("40Gi", "500M", "250m", "1e3"): parsed exactly, formatted canonically.

Pure. One definition for every place that reads or writes a quantity: claim configs (MPS memory limits),
published capacities and counters, and the `quantity()` of DRA's CEL environment.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)"  # "1", "1.", "1.5", ".5"
_SUFFIX = r"Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E"
_QUANTITY = re.compile(rf"({_NUMBER})(?:[eE]([+-]?[0-9]+)|({_SUFFIX})?)")
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_SCALE = {k: Fraction(2**e) for k, e in _BINARY.items()} | {k: Fraction(10) ** e for k, e in _DECIMAL.items()}
SYNTAX = f"a number with an optional suffix {_SUFFIX.replace('|', ', ')} or exponent, e.g. 40Gi, 500M, 250m, 1e3"
# Far beyond any real quantity (Kubernetes' own limit is near 2**63); bounds the work `1e999999999` would cost.
MAX_EXPONENT = 1000
# Digits of the number itself, for the same reason (and Python refuses int() of 4300+ digits with a ValueError).
MAX_DIGITS = 100


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity; `reason` says what is wanted instead."""

    def __init__(self, text: object, reason: str = SYNTAX) -> None:
        super().__init__(f"{text!r} is not a Kubernetes quantity ({reason})")
        self.reason = reason


class Quantity(Fraction):
    """A quantity: its exact value (it *is* that Fraction, so it compares and adds as a number) and its text.

    Equality and order are by value, as Kubernetes' Quantity.Cmp: Quantity("1Gi") == Quantity("1024Mi").
    """

    __slots__ = ("text",)
    text: str

    def __new__(cls, text: str) -> Quantity:
        written = text.strip()
        m = _QUANTITY.fullmatch(written)
        if m is None:
            raise QuantityError(text)
        number, exponent, suffix = m.groups()
        if len(number) > MAX_DIGITS:
            raise QuantityError(f"{written[:20]}...", f"it has more than {MAX_DIGITS} digits")
        if exponent is not None and abs(int(exponent)) > MAX_EXPONENT:
            raise QuantityError(text, f"its exponent is beyond ±{MAX_EXPONENT}")
        scale = Fraction(10) ** int(exponent) if exponent is not None else _SCALE[suffix or ""]
        self = super().__new__(cls, Fraction(number) * scale)
        self.text = written
        return self

    @property
    def value(self) -> Fraction:
        """The exact value as a plain Fraction."""
        return Fraction(self)

    def ceil(self) -> int:
        """The value as a whole number, rounded up as Kubernetes' Quantity.Value() does."""
        return -(-self.numerator // self.denominator)

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Quantity({self.text!r})"

    # Fraction rebuilds copies from (numerator, denominator); a Quantity is immutable and rebuilt from its text.
    def __reduce__(self) -> tuple[type[Quantity], tuple[str]]:
        return (Quantity, (self.text,))

    def __copy__(self) -> Quantity:
        return self

    def __deepcopy__(self, memo: Any) -> Quantity:
        return self


def parse(text: str) -> Quantity:
    """`"1Gi"`, `"500M"`, `"250m"`, `"1e3"`, `"42"`; anything else is a QuantityError saying what is wanted."""
    if not isinstance(text, str):
        raise QuantityError(text, "want a string such as '40Gi'")
    return Quantity(text)


def format_bytes(value: int) -> str:
    """Bytes and counts in canonical form: the largest exact binary suffix ("80Gi"), else plain digits."""
    for suffix, power in reversed(_BINARY.items()):
        if value and value % (1 << power) == 0:
            return f"{value >> power}{suffix}"
    return str(value)
