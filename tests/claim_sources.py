"""ResourceClaim sources for tests (the node agent reads claims through agent.kube.claims.KubeClaimSource):
claims held in memory, or stored as files."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class ClaimNotFound(LookupError):
    """No claim of that namespace and name."""


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
