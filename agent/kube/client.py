"""Building an API client: a kubeconfig file when given, in-cluster config otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kubernetes import client, config

# (connect, read) seconds for every call: a stalled API server must fail a prepare, not hang it while the
# node lock is held.
REQUEST_TIMEOUT = (5.0, 30.0)
# Keyword arguments for calls that want the server's JSON as sent (no model decoding) within the timeout.
RAW: dict[str, Any] = {"_preload_content": False, "_request_timeout": REQUEST_TIMEOUT}


# HTTP connections kept per client. The library's default is five per CPU, ten on a 2-core node: the arbiter's
# commit workers, informers and event writer outnumber that, and every connection beyond the pool was dropped
# after its request and the next one paid a new TLS handshake (CPU on both ends).
POOL_CONNECTIONS = 64


class KubeconfigError(Exception):
    """No usable API client configuration; str() says which file or setting and why."""


def api_client(kubeconfig: str | None = None) -> client.ApiClient:
    """A client from `kubeconfig`, or the in-cluster service account; no request is made."""
    cfg = client.Configuration()
    if kubeconfig:
        path = Path(kubeconfig)
        if not path.exists():
            raise KubeconfigError(f"kubeconfig {kubeconfig} does not exist")
        if not path.is_file():
            raise KubeconfigError(f"kubeconfig {kubeconfig} is not a file")
        try:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
        except Exception as exc:  # the loader fails in many ways (YAML, missing keys, wrong types, I/O)
            raise KubeconfigError(f"kubeconfig {kubeconfig} is not usable: {exc}") from None
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException as exc:
            raise KubeconfigError(
                f"no kubeconfig given and the in-cluster configuration is not usable ({exc}); "
                "pass --kubeconfig or set KUBECONFIG when running outside a cluster"
            ) from None
    cfg.connection_pool_maxsize = POOL_CONNECTIONS
    return client.ApiClient(cfg)
