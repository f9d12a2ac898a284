"""The API server's Kubernetes version (GET /version), which decides the ResourceSlice shape the agent publishes."""

from __future__ import annotations

from agent.kube.rest import Rest


def server_version(rest: Rest) -> str:
    """`gitVersion` as the server reports it, e.g. "v1.36.2"."""
    return str(rest.version().get("gitVersion") or "")
