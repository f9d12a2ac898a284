"""ResourceSlice calls for one node's driver, as plain JSON dicts exactly as the server returns them.

Objects stay dicts (not client models) so that fields this client version does not model, or that the
server dropped, are visible to the caller; errors come out as agent.kube.errors types.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

from kubernetes import client

from agent.kube.client import RAW
from agent.kube.errors import NotFound, call
from agent.kube.reflector import Reflector
from agent.kube.rest import RESOURCE_SLICES, Rest

Json = dict[str, Any]


class SliceApi:
    def __init__(self, api_client: client.ApiClient) -> None:
        self._api: Any = client.ResourceV1Api(api_client)  # takes dict bodies; typed as models

    def list(self, node_name: str, driver: str) -> list[Json]:
        """This node's slices of this driver (both selectors are served for ResourceSlices)."""
        selector = f"spec.nodeName={node_name},spec.driver={driver}"
        body = _json(call(lambda: self._api.list_resource_slice(field_selector=selector, **RAW)))
        return list(body.get("items") or [])

    def create(self, body: Json) -> Json:
        return _json(call(lambda: self._api.create_resource_slice(body, **RAW)))

    def replace(self, body: Json) -> Json:
        """Update; `metadata.resourceVersion` in `body` makes a concurrent change a Conflict."""
        name = body["metadata"]["name"]
        return _json(call(lambda: self._api.replace_resource_slice(name, body, **RAW)))

    def delete(self, name: str) -> None:
        """Delete; already gone counts as done."""
        with contextlib.suppress(NotFound):
            call(lambda: self._api.delete_resource_slice(name, **RAW))


def watch_changes(
    api_client: client.ApiClient, node_name: str, driver: str, on_change: Callable[[str, str], None]
) -> Reflector:
    """A watch (not started) of this node's slices of this driver that calls `on_change(kind, name)` for
    each one DELETED, and `on_change("LISTED", "")` after each (re)list, which may hide deletions made while
    the watch was down. ADDED and MODIFIED are left out: they are mostly our own writes."""

    def on_event(kind: str, obj: Json) -> None:
        if kind == "DELETED":
            on_change(kind, str((obj.get("metadata") or {}).get("name") or ""))

    return Reflector(
        Rest(api_client),
        RESOURCE_SLICES,
        lambda items: on_change("LISTED", ""),
        on_event,
        field_selector=f"spec.nodeName={node_name},spec.driver={driver}",
        what=f"ResourceSlices of {driver} on {node_name}",
    )


def _json(response: Any) -> Json:
    data = response.data if hasattr(response, "data") else response
    parsed: Json = json.loads(data) if data else {}
    return parsed
