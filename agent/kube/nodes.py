"""Node lookups the agent needs: the Node's uid, for owner references on what the agent publishes, and a
watch of its labels (`nvidia.com/mig.config`)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kubernetes import client, watch

from agent.kube.client import REQUEST_TIMEOUT
from agent.kube.errors import NotFound, call

log = logging.getLogger(__name__)


def node_uid(api_client: client.ApiClient, name: str) -> str | None:
    """The Node's uid, or None when no such Node exists (e.g. a test cluster without Node objects)."""
    api = client.CoreV1Api(api_client)
    try:
        node = call(lambda: api.read_node(name, _request_timeout=REQUEST_TIMEOUT))
    except NotFound:
        return None
    uid = node.metadata.uid if node.metadata else None
    return str(uid) if uid else None


class NodeLabelWatch:
    """Lists, then watches, one Node by name, and calls `on_labels` with its labels after each list and on
    every change. Any error (a dropped watch, 410 Gone, an unreachable server) means a fresh list after
    `backoff_s`; `run` returns when `stop` is set (at the latest when the watch's timeout ends)."""

    def __init__(
        self,
        api_client: client.ApiClient,
        name: str,
        on_labels: Callable[[dict[str, str]], None],
        *,
        timeout_s: int = 60,
        backoff_s: float = 1.0,
    ) -> None:
        self._api = client.CoreV1Api(api_client)
        self.name = name
        self._on_labels = on_labels
        self._timeout_s = timeout_s
        self._backoff_s = backoff_s
        self._last: dict[str, str] | None = None

    def run(self, stop: threading.Event) -> None:
        selector = f"metadata.name={self.name}"
        while not stop.is_set():
            try:
                listed = call(lambda: self._api.list_node(field_selector=selector, _request_timeout=REQUEST_TIMEOUT))
                for node in listed.items:
                    self._deliver(node)
                stream = watch.Watch().stream(
                    self._api.list_node,
                    field_selector=selector,
                    resource_version=listed.metadata.resource_version if listed.metadata else None,
                    timeout_seconds=self._timeout_s,
                    _request_timeout=(REQUEST_TIMEOUT[0], self._timeout_s + REQUEST_TIMEOUT[1]),
                )
                for event in stream:
                    if stop.is_set():
                        return
                    if event["type"] == "ERROR":
                        break  # e.g. 410 Gone: list again
                    if event["type"] in ("ADDED", "MODIFIED"):
                        self._deliver(event["object"])
            except Exception as exc:  # the watch must outlive any API trouble: list again after a pause
                log.warning("watching node %s failed, listing again: %s", self.name, exc)
                stop.wait(self._backoff_s)

    def _deliver(self, node: Any) -> None:
        labels = dict((node.metadata.labels if node.metadata else None) or {})
        if labels != self._last:
            self._last = labels
            self._on_labels(labels)
