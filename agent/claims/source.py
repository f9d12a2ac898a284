"""Where prepare reads ResourceClaims from. The daemon uses agent.kube.claims.KubeClaimSource; tests and
offline tools use the in-memory or file-backed sources here."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from agent.claims.types import ClaimRef

# The longest any one read may take when the caller has no deadline (the kubelet always sets one).
MAX_READ_SECONDS = 30.0


class ClaimNotFound(LookupError):
    """No claim of that namespace and name."""


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
    running at the deadline is left to end on its own (each is bounded by the same timeout)."""
    budget = MAX_READ_SECONDS if timeout is None else max(0.0, min(timeout, MAX_READ_SECONDS))
    deadline = time.monotonic() + budget
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
    late = ReadTimeout(f"no answer from the API server within the call's deadline ({budget:.1f}s)")
    return {ref.uid: results.get(ref.uid, late) for ref in refs}


class StaticClaimSource:
    """Claims held in memory, keyed by (namespace, name)."""

    def __init__(self, claims: Mapping[tuple[str, str], Mapping[str, Any]] | None = None) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = dict(claims or {})

    def put(self, claim: Mapping[str, Any]) -> None:
        meta = claim["metadata"]
        self.claims[(meta["namespace"], meta["name"])] = claim

    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise ClaimNotFound(f"resourceclaims {namespace}/{name} not found") from None


class FileClaimSource:
    """Claims stored as `<root>/<namespace>/<name>.json`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        try:
            claim: Mapping[str, Any] = json.loads((self.root / namespace / f"{name}.json").read_text())
        except FileNotFoundError:
            raise ClaimNotFound(f"resourceclaims {namespace}/{name} not found") from None
        return claim
