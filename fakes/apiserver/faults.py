"""Fault injection for reliability tests: error responses and added latency, set from the test process."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass

from .errors import ApiError


@dataclass
class _Failure:
    method: str  # "*" matches every method
    path: re.Pattern[str]
    status: int
    remaining: int


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[_Failure] = []
        self.delay = 0.0

    def fail(self, method: str, path_regex: str, status: int = 500, count: int = 1) -> None:
        """The next `count` requests whose method and path (without query) match get `status` back."""
        with self._lock:
            self._failures.append(_Failure(method.upper(), re.compile(path_regex), status, count))

    def latency(self, seconds: float) -> None:
        """Delay every request by `seconds` (0 turns it off)."""
        self.delay = seconds

    def clear(self) -> None:
        with self._lock:
            self._failures.clear()
        self.delay = 0.0

    def check(self, method: str, path: str) -> ApiError | None:
        """The injected error for this request, if any, consuming one of its count."""
        with self._lock:
            for failure in self._failures:
                if failure.remaining > 0 and failure.method in ("*", method) and failure.path.search(path):
                    failure.remaining -= 1
                    return ApiError(failure.status, f"injected fault: {method} {path} -> {failure.status}")
        return None
