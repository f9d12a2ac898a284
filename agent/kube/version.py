"""The API server's Kubernetes version (GET /version), which decides the ResourceSlice shape the agent publishes."""

from __future__ import annotations

from kubernetes import client

from agent.kube.client import REQUEST_TIMEOUT
from agent.kube.errors import call


def server_version(api_client: client.ApiClient) -> str:
    """`gitVersion` as the server reports it, e.g. "v1.36.2"."""
    info = call(lambda: client.VersionApi(api_client).get_code(_request_timeout=REQUEST_TIMEOUT))
    return str(info.git_version)
