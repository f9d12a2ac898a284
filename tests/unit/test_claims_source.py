"""read_claims: a batch's claims read at once within the call's deadline; a lone claim in the caller's thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from agent.claims.source import ReadTimeout, read_claims
from agent.claims.types import ClaimRef


class Source:
    """Answers each read with its claim's name after `delay` seconds (or raises `error` then), noting the thread
    that asked and the timeout it was given."""

    def __init__(self, delay: float = 0.0, error: Exception | None = None, meet: int = 0) -> None:
        self.delay = delay
        self.error = error
        self.asked: list[tuple[str, float | None]] = []
        self._met = threading.Barrier(meet) if meet else None

    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        self.asked.append((threading.current_thread().name, timeout))
        if self._met is not None:
            self._met.wait(timeout=5)  # every read of the batch is under way at once
        time.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return {"metadata": {"namespace": namespace, "name": name}}


def refs(n: int) -> list[ClaimRef]:
    return [ClaimRef("ns", f"uid-{i}", f"claim-{i}") for i in range(n)]


def test_a_lone_claim_is_read_in_the_callers_thread_within_the_deadline() -> None:
    """Tried: one claim with 2 s left. It is read without a thread hand-off, given the whole budget."""
    source = Source()
    [ref] = refs(1)
    assert read_claims(source, [ref], 2.0) == {ref.uid: {"metadata": {"namespace": "ns", "name": "claim-0"}}}
    [(thread, timeout)] = source.asked
    assert thread == threading.current_thread().name and timeout is not None and 0 < timeout <= 2.0


def test_a_lone_claim_failing_past_the_deadline_says_so_and_one_failing_before_keeps_its_error() -> None:
    """Tried: a read that times out at the deadline, and one refused at once. The first reads as the call's
    deadline passed (what the kubelet shows), the second keeps the source's own error."""
    [ref] = refs(1)
    late = read_claims(Source(delay=0.2, error=TimeoutError("read timed out")), [ref], 0.1)[ref.uid]
    assert isinstance(late, ReadTimeout) and "within the call's deadline (0.1s)" in str(late)
    refused = read_claims(Source(error=ConnectionRefusedError("refused")), [ref], 5.0)[ref.uid]
    assert isinstance(refused, ConnectionRefusedError)


def test_a_batch_is_read_at_once_and_a_stalled_read_costs_one_deadline() -> None:
    """Tried: three claims whose reads each wait until all three have begun, then three that stall past a
    0.3 s deadline. The first batch is read in parallel; the second returns by the deadline, not three."""
    read = read_claims(Source(meet=3), refs(3), 5.0)
    assert sorted(read) == ["uid-0", "uid-1", "uid-2"] and not any(isinstance(v, Exception) for v in read.values())
    start = time.monotonic()
    stalled = read_claims(Source(delay=2.0), refs(3), 0.3)
    assert time.monotonic() - start < 1.0
    assert all(isinstance(v, ReadTimeout) for v in stalled.values())
