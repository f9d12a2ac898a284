"""Node lookups the agent needs: the Node's uid, for owner references on what the agent publishes."""

from __future__ import annotations

from kubernetes import client

from agent.kube.client import REQUEST_TIMEOUT
from agent.kube.errors import NotFound, call


def node_uid(api_client: client.ApiClient, name: str) -> str | None:
    """The Node's uid, or None when no such Node exists (e.g. a test cluster without Node objects)."""
    api = client.CoreV1Api(api_client)
    try:
        node = call(lambda: api.read_node(name, _request_timeout=REQUEST_TIMEOUT))
    except NotFound:
        return None
    uid = node.metadata.uid if node.metadata else None
    return str(uid) if uid else None
