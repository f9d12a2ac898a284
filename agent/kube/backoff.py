"""The one retry backoff: exponential from `first_s`, doubling up to `max_s`, back to `first_s` after a success.

Every loop that retries a failed API call waits by it (the reflector's list and watch, the slice publisher's
writes and its resync). `jitter` stretches each delay by up to that fraction, drawn by `rand`, so that the
node agents of a cluster, failing together when the API server went away, do not all come back together
(client-go's wait.Backoff has the same Jitter). The caller waits (on its stop event, or its injected sleep).
"""

from __future__ import annotations

import random
from collections.abc import Callable

# Node agents' retries of the same outage spread over up to half as long again.
SPREAD = 0.5


class Backoff:
    def __init__(
        self,
        first_s: float = 0.2,
        max_s: float = 10.0,
        *,
        jitter: float = 0.0,
        rand: Callable[[], float] = random.random,
    ) -> None:
        if not 0 < first_s <= max_s or jitter < 0:
            raise ValueError(f"a backoff needs 0 < first_s <= max_s and jitter >= 0 (got {first_s}, {max_s}, {jitter})")
        self._first, self._max, self._jitter, self._rand = first_s, max_s, jitter, rand
        self._next = first_s

    @property
    def max_s(self) -> float:
        return self._max

    def next(self) -> float:
        """The delay before the next try; each call after a failure doubles the following one (up to max_s)."""
        delay, self._next = self._next, min(self._next * 2, self._max)
        return delay * (1 + self._jitter * self._rand()) if self._jitter else delay

    def reset(self) -> None:
        """After a success: the next failure waits `first_s` again."""
        self._next = self._first
