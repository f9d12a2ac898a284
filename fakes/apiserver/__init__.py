"""An embedded Kubernetes API server for tests and the demo, spoken to by kubectl and the official client
unmodified.

    with fakes.apiserver.start() as server:
        server.rest().list(RESOURCE_SLICES)                         # the agent's own client
        kubernetes.client.ResourceV1Api(server.api_client())        # the official one (a dev dependency)
"""

from .errors import ApiError
from .server import ApiServer, start

__all__ = ["ApiError", "ApiServer", "start"]
