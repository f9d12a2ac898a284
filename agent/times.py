"""RFC 3339 times as the Kubernetes API writes them: UTC with `Z`, and the precision each field has.

metav1.Time (Events, conditions, taints) carries whole seconds, metav1.MicroTime (Leases) microseconds; the
arbiter's admission time carries milliseconds, because it is compared with times in the same second. Pure.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal


def rfc3339(t: float, digits: Literal[0, 3, 6] = 0) -> str:
    """Unix time `t` in UTC, with `digits` digits of the second's fraction (cut, never rounded up):
    0 for metav1.Time, 6 for metav1.MicroTime."""
    stamp = datetime.fromtimestamp(t, UTC)
    whole = stamp.strftime("%Y-%m-%dT%H:%M:%S")
    if digits == 0:
        return f"{whole}Z"
    return f"{whole}.{stamp.microsecond // 10 ** (6 - digits):0{digits}d}Z"


def parse_rfc3339(text: object) -> float | None:
    """The Unix time of an RFC 3339 date-time (any fraction, `Z` or an offset); None for anything else: not a
    string, empty, no time, or no time zone (a local time would depend on the machine reading it)."""
    if not isinstance(text, str) or len(text) < 20 or text[10] not in "Tt":
        return None
    try:
        parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1] in "Zz" else text)
    except ValueError:
        return None
    return parsed.timestamp() if parsed.tzinfo is not None else None
