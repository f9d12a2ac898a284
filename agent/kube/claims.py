"""ResourceClaims through the official client, as the API JSON agent.claims reads."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client

from agent.kube import errors
from agent.kube.client import REQUEST_TIMEOUT


class KubeClaimSource:
    """agent.claims.source.ClaimSource over resource.k8s.io/v1. Raises agent.kube.errors (NotFound, ...).

    Its own client, without urllib3's retries: three silent retries of a stalled read would turn the
    caller's deadline into four of them (the kubelet retries a failed prepare itself)."""

    def __init__(self, api: client.ApiClient) -> None:
        configuration = copy.deepcopy(api.configuration)
        configuration.retries = False
        self._resource = client.ResourceV1Api(client.ApiClient(configuration))

    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        # Raw JSON, not the client's models: opaque config parameters and fields newer than this client
        # arrive exactly as the server sent them, and skipping model decoding keeps prepare fast. A single
        # number is urllib3's total timeout: connecting and reading together.
        limit = REQUEST_TIMEOUT[1] if timeout is None else min(timeout, REQUEST_TIMEOUT[1])
        response: Any = errors.call(
            lambda: self._resource.read_namespaced_resource_claim(
                name, namespace, _preload_content=False, _request_timeout=limit
            )
        )
        claim: Mapping[str, Any] = json.loads(response.data)
        return claim


def allocated_in_pool(api: client.ApiClient, driver: str, pool: str) -> dict[str, list[str]]:
    """Every ResourceClaim whose allocation takes `driver`'s devices from `pool`, as `namespace/name` -> those
    device names: allocated claims, prepared or not (a pod bound, the kubelet not there yet). One list of all
    claims, raw JSON; raises agent.kube.errors.ApiError."""
    resource = client.ResourceV1Api(api)
    response: Any = errors.call(
        lambda: resource.list_resource_claim_for_all_namespaces(
            _preload_content=False, _request_timeout=REQUEST_TIMEOUT
        )
    )
    held: dict[str, list[str]] = {}
    for claim in json.loads(response.data).get("items") or ():
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()
        devices = [str(r.get("device")) for r in results if r.get("driver") == driver and r.get("pool") == pool]
        if devices:
            meta = claim.get("metadata") or {}
            held[f"{meta.get('namespace')}/{meta.get('name')}"] = devices
    return held
