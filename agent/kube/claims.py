"""ResourceClaims as the API JSON agent.claims reads."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.kube.rest import RESOURCE_CLAIMS, Rest


class KubeClaimSource:
    """agent.claims.source.ClaimSource over resource.k8s.io/v1. Raises agent.kube.errors (NotFound, ...).

    Without retries: three silent retries of a stalled read would turn the caller's deadline into four of them
    (the kubelet retries a failed prepare itself)."""

    def __init__(self, rest: Rest) -> None:
        self._rest = rest.without_retries()

    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        # Raw JSON: opaque config parameters and fields newer than this agent arrive exactly as the server
        # sent them. `timeout` bounds connecting and reading together.
        limit = None if timeout is None else min(timeout, self._rest.client.timeout[1])
        return self._rest.get(RESOURCE_CLAIMS, namespace, name, timeout=limit)


def allocated_in_pool(rest: Rest, driver: str, pool: str) -> dict[str, list[str]]:
    """Every ResourceClaim whose allocation takes `driver`'s devices from `pool`, as `namespace/name` -> those
    device names: allocated claims, prepared or not (a pod bound, the kubelet not there yet). One list of all
    claims, raw JSON; raises agent.kube.errors.ApiError."""
    held: dict[str, list[str]] = {}
    for claim in rest.list(RESOURCE_CLAIMS).get("items") or ():
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()
        devices = [str(r.get("device")) for r in results if r.get("driver") == driver and r.get("pool") == pool]
        if devices:
            meta = claim.get("metadata") or {}
            held[f"{meta.get('namespace')}/{meta.get('name')}"] = devices
    return held
