"""Where prepare reads ResourceClaims from (the daemon's is agent.kube.claims.KubeClaimSource), and the read of
a batch's claims within the kubelet's deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from agent.claims.types import ClaimRef

# The longest any one read may take when the caller has no deadline (the kubelet always sets one).
MAX_READ_SECONDS = 30.0


class ClaimSource(Protocol):
    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        """The claim as API JSON (camelCase, as `kubectl get -o json` prints it), within `timeout` seconds."""
        ...


class ReadTimeout(TimeoutError):
    """The claim was not read within the caller's deadline."""


def read_claims(
    source: ClaimSource, refs: Sequence[ClaimRef], timeout: float | None
) -> dict[str, Mapping[str, Any] | Exception]:
    """Each claim, or the exception that reading it raised, all read at once and none waited for past
    `timeout` seconds: a stalled API server costs a batch one deadline, not one per claim. A read still
    running at the deadline is left to end on its own (each is bounded by the same timeout).

    A lone claim (the usual batch) is read in the caller's thread, bounded by the source's own timeout: a
    thread of its own would add two wake-ups to every prepare, and on a busy machine each waits for a CPU
    (100 ms and more, measured beside other people's work on the 2-core VM)."""
    budget = MAX_READ_SECONDS if timeout is None else max(0.0, min(timeout, MAX_READ_SECONDS))
    deadline = time.monotonic() + budget
    late = ReadTimeout(f"no answer from the API server within the call's deadline ({budget:.1f}s)")
    if len(refs) == 1:
        ref = refs[0]
        try:
            return {ref.uid: source.get(ref.namespace, ref.name, timeout=max(0.001, budget))}
        except Exception as exc:  # the claim's error, reported by the caller
            return {ref.uid: late if time.monotonic() >= deadline else exc}
    results: dict[str, Mapping[str, Any] | Exception] = {}
    finished = threading.Semaphore(0)

    def read(ref: ClaimRef) -> None:
        try:
            results[ref.uid] = source.get(ref.namespace, ref.name, timeout=max(0.001, deadline - time.monotonic()))
        except Exception as exc:  # the claim's error, reported by the caller
            results[ref.uid] = exc
        finally:
            finished.release()

    for ref in refs:
        threading.Thread(target=read, args=(ref,), name=f"claim-read-{ref.uid[:36]}", daemon=True).start()
    for _ in refs:
        if not finished.acquire(timeout=max(0.0, deadline - time.monotonic())):
            break
    return {ref.uid: results.get(ref.uid, late) for ref in refs}
