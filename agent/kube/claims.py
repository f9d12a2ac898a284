"""ResourceClaims through the official client, as the API JSON agent.claims reads."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kubernetes import client

from agent.kube import errors
from agent.kube.client import RAW


class KubeClaimSource:
    """agent.claims.source.ClaimSource over resource.k8s.io/v1. Raises agent.kube.errors (NotFound, ...)."""

    def __init__(self, api: client.ApiClient) -> None:
        self._resource = client.ResourceV1Api(api)

    def get(self, namespace: str, name: str) -> Mapping[str, Any]:
        # Raw JSON, not the client's models: opaque config parameters and fields newer than this client
        # arrive exactly as the server sent them, and skipping model decoding keeps prepare fast.
        response: Any = errors.call(lambda: self._resource.read_namespaced_resource_claim(name, namespace, **RAW))
        claim: Mapping[str, Any] = json.loads(response.data)
        return claim
