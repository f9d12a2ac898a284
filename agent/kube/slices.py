"""ResourceSlice calls for one node's driver, as plain JSON dicts exactly as the server returns them.

Objects stay dicts (not client models) so that fields this client version does not model, or that the
server dropped, are visible to the caller; errors come out as agent.kube.errors types.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from agent.jsontypes import Json
from agent.kube.errors import NotFound
from agent.kube.reflector import Reflector
from agent.kube.rest import RESOURCE_SLICES, Rest


class SliceApi:
    def __init__(self, rest: Rest) -> None:
        self._rest = rest

    def list(self, node_name: str, driver: str) -> list[Json]:
        """This node's slices of this driver (both selectors are served for ResourceSlices)."""
        selector = f"spec.nodeName={node_name},spec.driver={driver}"
        return list(self._rest.list(RESOURCE_SLICES, field_selector=selector).get("items") or [])

    def create(self, body: Json) -> Json:
        return self._rest.create(RESOURCE_SLICES, None, body)

    def replace(self, body: Json) -> Json:
        """Update; `metadata.resourceVersion` in `body` makes a concurrent change a Conflict."""
        return self._rest.replace(RESOURCE_SLICES, body)

    def delete(self, name: str) -> None:
        """Delete; already gone counts as done."""
        with contextlib.suppress(NotFound):
            self._rest.delete(RESOURCE_SLICES, None, name)


def watch_changes(rest: Rest, node_name: str, driver: str, on_change: Callable[[str, str], None]) -> Reflector:
    """A watch (not started) of this node's slices of this driver that calls `on_change(kind, name)` for
    each one DELETED, and `on_change("LISTED", "")` after each (re)list, which may hide deletions made while
    the watch was down. ADDED and MODIFIED are left out: they are mostly our own writes."""

    def on_event(kind: str, obj: Json) -> None:
        if kind == "DELETED":
            on_change(kind, str((obj.get("metadata") or {}).get("name") or ""))

    return Reflector(
        rest,
        RESOURCE_SLICES,
        lambda items: on_change("LISTED", ""),
        on_event,
        field_selector=f"spec.nodeName={node_name},spec.driver={driver}",
        what=f"ResourceSlices of {driver} on {node_name}",
    )
