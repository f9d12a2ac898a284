"""Building an API client: a kubeconfig file when given, in-cluster config otherwise."""

from __future__ import annotations

from typing import Any

from kubernetes import client, config

# (connect, read) seconds for every call: a stalled API server must fail a prepare, not hang it while the
# node lock is held.
REQUEST_TIMEOUT = (5.0, 30.0)
# Keyword arguments for calls that want the server's JSON as sent (no model decoding) within the timeout.
RAW: dict[str, Any] = {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT}


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    cfg = client.Configuration()
    config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)
