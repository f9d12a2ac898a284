"""This node's Node object as the agent needs it: its uid (the owner of what the agent publishes; a Node
deleted and created again has a new one) and its labels (e.g. `nvidia.com/mig.config`).

One NodeWatcher serves both: the publisher follows the uid, the MIG reconciler the labels."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from agent.jsontypes import Json
from agent.kube.backoff import Backoff
from agent.kube.errors import NotFound
from agent.kube.reflector import Reflector
from agent.kube.rest import NODES, Rest

log = logging.getLogger(__name__)


def node_uid(rest: Rest, name: str) -> str | None:
    """The Node's uid, or None when no such Node exists (e.g. a test cluster without Node objects)."""
    try:
        return NodeInfo.of(rest.get(NODES, None, name)).uid
    except NotFound:
        return None


@dataclass(frozen=True)
class NodeInfo:
    """What the agent uses of its Node; `uid` None means there is no Node object of that name."""

    uid: str | None
    labels: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, obj: Json | None) -> NodeInfo:
        meta = (obj or {}).get("metadata") or {}
        labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
        return cls(str(meta["uid"]) if meta.get("uid") else None, MappingProxyType(labels))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NodeInfo) and (self.uid, dict(self.labels)) == (other.uid, dict(other.labels))

    def __hash__(self) -> int:
        return hash((self.uid, tuple(sorted(self.labels.items()))))


Subscriber = Callable[[NodeInfo], None]


class NodeWatcher:
    """Lists and watches one Node by name and tells subscribers each time its uid or labels change.

    Subscribers are called on the watch thread, in subscription order, with the new NodeInfo; the first
    call comes after the first successful list (with `uid=None` when the Node does not exist). They must
    return quickly and make no API calls: hand the work to a thread of your own.
    """

    def __init__(self, rest: Rest, name: str, *, timeout_s: int = 300, backoff: Backoff | None = None) -> None:
        self.name = name
        self._lock = threading.RLock()  # also held while delivering: subscribers see changes in order
        self._subscribers: list[Subscriber] = []
        self._current: NodeInfo | None = None
        self._synced = threading.Event()
        self._watch = Reflector(
            rest,
            NODES,
            self._on_list,
            self._on_event,
            field_selector=f"metadata.name={name}",
            what=f"Node {name}",
            watch_timeout_s=timeout_s,
            backoff=backoff,
        )

    @property
    def current(self) -> NodeInfo | None:
        """The Node as last seen; None until the first list succeeded."""
        with self._lock:
            return self._current

    def subscribe(self, subscriber: Subscriber) -> None:
        """Add a subscriber; if the Node was already seen, it is called at once with the current state."""
        with self._lock:
            self._subscribers.append(subscriber)
            if self._current is not None:
                self._deliver([subscriber], self._current)

    def wait_synced(self, timeout: float | None = None) -> bool:
        """Block until the first list succeeded (True) or `timeout` passed (False)."""
        return self._synced.wait(timeout)

    def start(self) -> None:
        self._watch.start(name=f"node-watch-{self.name}")

    def stop(self) -> None:
        self._watch.stop()

    def run(self) -> None:
        """Watch in the calling thread until `stop()`."""
        self._watch.run()

    # --- watch callbacks ------------------------------------------------------------------------------

    def _on_list(self, items: list[Json]) -> None:
        own = next((o for o in items if (o.get("metadata") or {}).get("name") == self.name), None)
        self._update(NodeInfo.of(own))
        self._synced.set()

    def _on_event(self, kind: str, obj: Json) -> None:
        if (obj.get("metadata") or {}).get("name") != self.name:
            return
        self._update(NodeInfo(None) if kind == "DELETED" else NodeInfo.of(obj))

    def _update(self, info: NodeInfo) -> None:
        with self._lock:
            if info == self._current:
                return
            previous, self._current = self._current, info
            if previous is not None and previous.uid != info.uid:
                if info.uid is None:
                    log.warning("Node %s was deleted", self.name)
                else:
                    log.info("Node %s has a new uid", self.name, extra={"uid": info.uid, "previous_uid": previous.uid})
            self._deliver(self._subscribers, info)

    @staticmethod
    def _deliver(subscribers: list[Subscriber], info: NodeInfo) -> None:
        for subscriber in subscribers:
            try:
                subscriber(info)
            except Exception:  # one subscriber's bug must not starve the others of the change
                log.exception("a Node change subscriber failed")
