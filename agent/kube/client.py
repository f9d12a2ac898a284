"""Building an API client: a kubeconfig file when given, in-cluster config otherwise."""

from __future__ import annotations

from kubernetes import client, config


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    cfg = client.Configuration()
    config.load_incluster_config(client_configuration=cfg)
    return client.ApiClient(cfg)
