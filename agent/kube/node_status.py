"""What the agent tells people about its Node: labels it owns (a merge patch of just those) and Events.

Events are core/v1 Events on the Node in namespace `default`, as the kubelet writes its own node events, so
`kubectl describe node` and `kubectl get events --field-selector involvedObject.name=<node>` show them.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from agent.kube.errors import ApiError
from agent.kube.rest import EVENTS, NODES, Rest
from agent.times import rfc3339

log = logging.getLogger(__name__)

EVENT_NAMESPACE = "default"
COMPONENT = "gpu-dra-agent"


def node_labels(rest: Rest, node_name: str) -> dict[str, str]:
    """The Node's labels now (raises agent.kube.errors.ApiError, NotFound when there is no such Node)."""
    labels = (rest.get(NODES, None, node_name).get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in labels.items()}


class NodeStatus:
    """Labels and Events of one Node."""

    def __init__(self, rest: Rest, node_name: str, node_uid: str | None = None) -> None:
        self._rest = rest
        self.node_name = node_name
        self._node_uid = node_uid

    def set_labels(self, labels: dict[str, str | None]) -> None:
        """Set (or, for None, remove) these labels and no others. Raises ApiError."""
        body = {"metadata": {"labels": labels}}
        self._rest.patch(NODES, None, self.node_name, body)

    def event(self, event_type: str, reason: str, message: str) -> None:
        """Record an Event on the Node; a failure is logged, never raised (the Event is for people, the
        work goes on)."""
        now = rfc3339(time.time())
        involved = {"apiVersion": "v1", "kind": "Node", "name": self.node_name}
        if self._node_uid:
            involved["uid"] = self._node_uid
        body: Any = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{self.node_name}.{time.time_ns():x}", "namespace": EVENT_NAMESPACE},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": event_type,
            "source": {"component": COMPONENT, "host": self.node_name},
            "reportingComponent": COMPONENT,
            "reportingInstance": self.node_name,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self._rest.create(EVENTS, EVENT_NAMESPACE, body)
        except ApiError as exc:
            log.warning("could not record Event %s on node %s: %s", reason, self.node_name, exc)
