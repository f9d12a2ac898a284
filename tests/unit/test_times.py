"""RFC 3339 times: each precision the API uses, and what a reader refuses."""

from __future__ import annotations

import pytest

from agent.times import parse_rfc3339, rfc3339

T = 1735689600.123456  # 2025-01-01T00:00:00.123456Z


def test_each_precision_is_written_in_utc_with_z_and_cut_not_rounded() -> None:
    assert rfc3339(T) == "2025-01-01T00:00:00Z"  # metav1.Time
    assert rfc3339(T, 3) == "2025-01-01T00:00:00.123Z"  # the arbiter's admission time
    assert rfc3339(T, 6) == "2025-01-01T00:00:00.123456Z"  # metav1.MicroTime
    assert rfc3339(1735689600.9996) == "2025-01-01T00:00:00Z"
    assert rfc3339(1735689600.9996, 3) == "2025-01-01T00:00:00.999Z"


@pytest.mark.parametrize("digits", [0, 3, 6])
def test_what_is_written_reads_back(digits: int) -> None:
    assert parse_rfc3339(rfc3339(T, digits)) == pytest.approx(T, abs=10**-digits)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2025-01-01T00:00:00Z", 1735689600.0),
        ("2025-01-01t00:00:00z", 1735689600.0),
        ("2025-01-01T01:00:00+01:00", 1735689600.0),
        ("2025-01-01T00:00:00.5Z", 1735689600.5),
        ("2025-01-01T00:00:00.123456789Z", 1735689600.123456),  # Go's RFC3339Nano: cut to microseconds
    ],
)
def test_any_rfc3339_date_time_is_read(text: str, expected: float) -> None:
    assert parse_rfc3339(text) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize(
    "text",
    [
        None,
        0,
        "",
        "2025-01-01",
        "2025-01-01T00:00:00",
        "2025-01-01 00:00:00Z",
        "yesterday at noon Z",
        "2025-13-01T00:00:00Z",
    ],
)
def test_anything_else_reads_as_no_time(text: object) -> None:
    """Not a string, a date alone, no time zone (a local time), a space for the T, nonsense, a 13th month."""
    assert parse_rfc3339(text) is None
