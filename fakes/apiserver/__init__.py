"""An embedded Kubernetes API server for tests and the demo, spoken to by the official client unmodified.

    with fakes.apiserver.start() as server:
        api = kubernetes.client.ResourceV1Api(server.api_client())
"""

from .errors import ApiError
from .server import ApiServer, start

__all__ = ["ApiError", "ApiServer", "start"]
