"""Kubernetes quantities: exact values, comparison by value, canonical formatting, clear errors."""

from __future__ import annotations

import copy
import pickle
from fractions import Fraction

import pytest

from agent.quantity import MAX_EXPONENT, Quantity, QuantityError, format_bytes, parse

GiB = 1 << 30


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("40Gi", 40 * GiB),
        ("1.5Gi", 3 * GiB // 2),
        ("2Ei", 2 << 60),
        ("80G", 80 * 10**9),
        ("16k", 16_000),
        ("3E", 3 * 10**18),  # "E" alone is the exa suffix, not an exponent
        ("250m", Fraction(1, 4)),
        ("5u", Fraction(5, 10**6)),
        ("7n", Fraction(7, 10**9)),
        ("1e3", 1000),
        ("12E-1", Fraction(6, 5)),
        (".5", Fraction(1, 2)),
        ("2.", 2),
        ("-2k", -2000),
        ("+42", 42),
        (" 8Mi ", 8 << 20),
    ],
)
def test_values_are_exact(text: str, value: int | Fraction) -> None:
    q = parse(text)
    assert q == value and q.value == value
    assert type(q.value) is Fraction


def test_ceil_rounds_up_like_kubernetes_value() -> None:
    assert parse("1500m").ceil() == 2
    assert parse("40Gi").ceil() == 40 * GiB
    assert parse("1n").ceil() == 1


def test_comparison_is_by_value_not_spelling() -> None:
    assert parse("1Gi") == parse("1024Mi") == 2**30
    assert parse("1k") > parse("999") and parse("1Ki") > parse("1k")
    assert sorted(parse(t) for t in ("1Gi", "1G", "900Mi")) == [parse("900Mi"), parse("1G"), parse("1Gi")]
    assert {parse("1Gi"): "x"}[parse("1073741824")] == "x"  # equal values hash alike
    assert parse("1Gi") + parse("1Gi") == parse("2Gi")


def test_text_is_kept_as_written() -> None:
    q = parse(" 1.5Gi")
    assert q.text == str(q) == "1.5Gi"
    assert repr(q) == "Quantity('1.5Gi')"
    for clone in (copy.copy(q), copy.deepcopy(q), pickle.loads(pickle.dumps(q))):
        assert isinstance(clone, Quantity) and clone.text == "1.5Gi" and clone == q


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (80 * GiB, "80Gi"),
        (1536, "1536"),
        (9984 << 20, "9984Mi"),
        (3 << 50, "3Pi"),
        (2 << 60, "2Ei"),
        (0, "0"),
        (7, "7"),
    ],
)
def test_format_bytes_is_canonical_and_round_trips(value: int, text: str) -> None:
    assert format_bytes(value) == text
    assert parse(format_bytes(value)) == value


@pytest.mark.parametrize("bad", ["40GB", "1 Gi", "", "Gi", "1.2.3", "one", "5i", "0x10", "1e", "1e3Gi", "١٢"])
def test_malformed_text_is_refused_saying_what_is_wanted(bad: str) -> None:
    # Tried: human spellings, stray spaces, missing numbers, hex, non-ASCII digits, suffix plus exponent.
    with pytest.raises(QuantityError, match="not a Kubernetes quantity .*suffix") as caught:
        parse(bad)
    assert isinstance(caught.value, ValueError)
    assert repr(bad) in str(caught.value)


def test_a_huge_exponent_is_refused_instead_of_computed() -> None:
    # Tried: an exponent that would build a number with a billion digits.
    with pytest.raises(QuantityError, match=f"exponent is beyond ±{MAX_EXPONENT}"):
        parse("1e999999999")
    assert parse(f"1e{MAX_EXPONENT}") == 10**MAX_EXPONENT


@pytest.mark.parametrize("bad", [None, 5, 1.5, b"1Gi"])
def test_non_text_is_refused(bad: object) -> None:
    # Tried: JSON numbers and bytes where the text of a quantity belongs.
    with pytest.raises(QuantityError, match="want a string"):
        parse(bad)  # type: ignore[arg-type]
