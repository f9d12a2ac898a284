"""The allocator against an API server: read slices, classes and claims, write the claim's status.allocation."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import client

from agent.allocation.cel import Json
from fakes.scheduler.allocator import allocate


class FakeScheduler:
    """What kube-scheduler's DRA plugin does for one claim, minus pods: allocate it and record the allocation."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self._api: Any = client.ResourceV1Api(api_client)  # Any: bodies are raw API JSON, not client models

    def allocate(self, namespace: str, name: str, *, node: str | None = None) -> Json:
        """Allocate the claim (Unsatisfiable if it cannot be), write status.allocation; the updated claim."""
        claim = self._raw(self._api.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        if (claim.get("status") or {}).get("allocation"):
            return claim  # allocated already: kube-scheduler never re-allocates
        allocation = allocate(
            claim,
            self._items(self._api.list_resource_slice(_preload_content=False)),
            self._items(self._api.list_device_class(_preload_content=False)),
            self._items(self._api.list_resource_claim_for_all_namespaces(_preload_content=False)),
            node=node,
        )
        claim["status"] = {**(claim.get("status") or {}), "allocation": allocation}
        return self._raw(
            self._api.replace_namespaced_resource_claim_status(name, namespace, claim, _preload_content=False)
        )

    def deallocate(self, namespace: str, name: str) -> Json:
        """Clear status.allocation (and reservedFor), as kube-scheduler or the claim controller does."""
        claim = self._raw(self._api.read_namespaced_resource_claim(name, namespace, _preload_content=False))
        status = {k: v for k, v in (claim.get("status") or {}).items() if k not in ("allocation", "reservedFor")}
        claim["status"] = status
        return self._raw(
            self._api.replace_namespaced_resource_claim_status(name, namespace, claim, _preload_content=False)
        )

    @staticmethod
    def _raw(response: Any) -> Json:
        data: Json = json.loads(response.data)
        return data

    @classmethod
    def _items(cls, response: Any) -> list[Json]:
        items: list[Json] = cls._raw(response).get("items") or []
        return items
