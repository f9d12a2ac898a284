"""Keeps this node's ResourceSlices in the API equal to what the inventory says.

`publish` is called when the inventory changes and writes nothing when the pool content is what was last
published. `resync` re-reads the API and repairs slices deleted or edited behind our back; `run` drives
both on an interval. Every content change gets a new pool generation, written to every slice of the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from agent import quantity
from agent.devices.model import Inventory
from agent.devices.shares import Policy, ShareMode
from agent.jsontypes import Json
from agent.kube import nodes
from agent.kube.backoff import SPREAD, Backoff
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.rest import Rest
from agent.kube.slices import SliceApi
from agent.slices.build import DEFAULT_DRIVER, SliceContent, Taints, pool_content, resource_slices
from agent.slices.versions import LATEST, SliceRules, rules_for
from agent.times import parse_rfc3339

log = logging.getLogger(__name__)


class SliceStore(Protocol):
    """The API calls the publisher makes (agent.kube.slices.SliceApi)."""

    def list(self, node_name: str, driver: str) -> list[Json]: ...
    def create(self, body: Json) -> Json: ...
    def replace(self, body: Json) -> Json: ...
    def delete(self, name: str) -> None: ...


@dataclass(frozen=True)
class PublishResult:
    devices: int  # devices in the pool now
    slices: int
    generation: int
    created: int = 0
    updated: int = 0
    deleted: int = 0

    @property
    def wrote(self) -> bool:
        return bool(self.created or self.updated or self.deleted)


class CountersDropped(Exception):
    """The server stored a slice without sharedCounters/consumesCounters (DRAPartitionableDevices off)."""


class SharesDropped(Exception):
    """The server stored a slice without allowMultipleAllocations (DRAConsumableCapacity off)."""


class Publisher:
    def __init__(
        self,
        rest: Rest | None,
        node_name: str,
        driver_name: str = DEFAULT_DRIVER,
        *,
        partitionable: bool = False,
        node_uid: str | None = None,
        rules: SliceRules | None = None,
        taints: Callable[[], Taints] | None = None,
        share_mode: ShareMode | None = None,
        max_attempts: int = 5,
        backoff_s: float = 0.05,
        retry_s: float = 0.5,
        store: SliceStore | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if store is None:
            if rest is None:
                raise ValueError("a Publisher needs an API client or a slice store")
            store = SliceApi(rest)
        self._rest = rest
        self._store = store
        self.node_name = node_name
        self.driver = driver_name
        self._partitionable = partitionable
        self._node_uid = node_uid
        self._owner_known = node_uid is not None  # else looked up once, at the first write
        self._rules = rules  # the server version's; read from /version on first use when not given
        self._taints = taints  # device taints to publish where the server version serves them
        self._share_mode = share_mode  # whole GPUs shareable (consumable capacity) where the server keeps it
        self._max_attempts = max_attempts
        self._backoff_s = backoff_s
        self._retry_s = retry_s  # first pause of `run` after a failed pass
        self._sleep = sleep
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inventory: Inventory | None = None
        self._published: tuple[SliceContent, ...] | None = None
        self._generation = 0
        self._writing: tuple[tuple[SliceContent, ...], str | None] | None = None  # a pass not finished
        self._last = PublishResult(0, 0, 0)

    @property
    def partitionable(self) -> bool:
        """False once the server was seen dropping counter fields, whatever the flag said."""
        return self._partitionable

    @property
    def share_mode(self) -> ShareMode | None:
        """The consumable-shares mode in effect: None once the server is too old for it or dropped it."""
        return self._share_mode

    @property
    def known_rules(self) -> SliceRules | None:
        """The server version's rules once read; None before the API has answered."""
        return self._rules

    @property
    def rules(self) -> SliceRules:
        """The ResourceSlice rules of the server's Kubernetes version, which shape every slice published."""
        if self._rules is None:
            self._rules = rules_for(self._rest.server_version() if self._rest is not None else LATEST.label)
            log.info("API server is Kubernetes %s: publishing its ResourceSlice shape", self._rules.label)
        return self._rules

    @property
    def published_devices(self) -> int:
        return self._last.devices

    def set_node_uid(self, uid: str | None) -> bool:
        """The Node's uid as watched (None: no Node object); True when it changed, and the slices need a
        resync to carry the new owner (a Node deleted and created again has a new uid, and a real cluster's
        garbage collector deletes slices owned by the old one)."""
        with self._lock:
            changed = uid != self._node_uid or not self._owner_known
            self._node_uid, self._owner_known = uid, True
            if changed:
                self._published = None  # the next publish writes even if the content is the same
            return changed

    def publish(self, inventory: Inventory) -> PublishResult:
        """Make the API match `inventory`; no request at all when its content was already published."""
        with self._lock:
            self._inventory = inventory
            content = self._content()
            if content == self._published:
                return PublishResult(self._last.devices, self._last.slices, self._last.generation)
            try:
                return self._reconcile(content)
            except Exception:
                self._wake.set()  # `run` retries soon, not at the end of its interval
                raise

    def resync(self, inventory: Inventory | None = None) -> PublishResult:
        """Re-read this node's slices and repair whatever differs from the last (or given) inventory."""
        with self._lock:
            if inventory is not None:
                self._inventory = inventory
            if self._inventory is None:
                return self._last
            return self._reconcile(self._content())

    def withdraw_ownerless(self) -> int:
        """At stop, when no Node of this name exists: delete the pool's slices, which no garbage collector would
        ever remove (they have no owner); slices owned by a Node stay for the restarted agent. The count deleted."""
        with self._lock:
            if not self._owner_known or self._node_uid is not None:
                return 0
            try:
                names = [s["metadata"]["name"] for s in self._store.list(self.node_name, self.driver)]
                for name in names:
                    self._store.delete(name)
            except ApiError as exc:
                log.warning("could not withdraw the ownerless ResourceSlices of pool %s: %s", self.node_name, exc)
                return 0
            self._published = None
            if names:
                log.info(
                    "withdrew %d ownerless ResourceSlice(s) of pool %s: there is no Node %s",
                    len(names),
                    self.node_name,
                    self.node_name,
                )
            return len(names)

    def wake(self) -> None:
        """Have `run` resync now instead of at the end of its interval (the Node or a slice changed)."""
        self._wake.set()

    def run(
        self,
        stop: threading.Event,
        inventory_source: Callable[[], Inventory],
        interval_s: float = 30.0,
        on_result: Callable[[PublishResult], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Resync every `interval_s` and on each `wake()` until `stop` is set. A failed pass (or a failed
        `publish` elsewhere) is retried after `retry_s`, doubling up to `interval_s` (each delay stretched by up to
        half, agent.kube.backoff, so the nodes of a cluster come back apart after an outage): a pool left half
        written (slices of mixed generations, which the scheduler sees as incomplete) is fixed in seconds."""
        failures = 0
        backoff = Backoff(self._retry_s, max(self._retry_s, interval_s), jitter=SPREAD)
        while not stop.is_set():
            self._wake.clear()  # a wake from now on asks for another pass
            try:
                result = self.resync(inventory_source())
            except Exception as exc:  # this loop is what repairs the slices: it must outlive any failure
                failures += 1
                delay = backoff.next()
                if isinstance(exc, ApiError):
                    log.warning("publishing ResourceSlices failed, retrying in %.1fs: %s", delay, exc)
                else:
                    log.exception("publishing ResourceSlices failed, retrying in %.1fs", delay)
                if on_error:
                    on_error(exc)
            else:
                if failures:
                    log.info("ResourceSlices published again after %d failed attempts", failures)
                failures, delay = 0, interval_s
                backoff.reset()
                if on_result:
                    on_result(result)
            self._pause(stop, delay)

    def _pause(self, stop: threading.Event, seconds: float) -> None:
        """Until `seconds` passed, `stop` is set or `wake()` is called (stop is looked at 4 times a second)."""
        deadline = time.monotonic() + seconds
        while not stop.is_set() and not self._wake.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.wait(min(left, 0.25))

    # --- internals (called with the lock held) ---------------------------------------------------------

    def _content(self) -> tuple[SliceContent, ...]:
        assert self._inventory is not None
        taints = self._taints() if self._taints is not None else None
        rules = self.rules
        if self._share_mode is not None and not rules.shares_served:
            log.warning(
                "--consumable-shares=%s needs Kubernetes 1.36 or later (DRAConsumableCapacity is alpha and off by "
                "default in %s); publishing whole GPUs",
                self._share_mode,
                rules.label,
            )
            self._share_mode = None
        return pool_content(
            self._inventory, partitionable=self._partitionable, rules=rules, taints=taints, share_mode=self._share_mode
        )

    def _reconcile(self, content: tuple[SliceContent, ...]) -> PublishResult:
        """One pass of list, compare, write; conflicts re-read at once, server errors back off."""
        error: ApiError | None = None
        backoff = Backoff(self._backoff_s, self._backoff_s * 2**self._max_attempts)  # uncapped within a pass
        for attempt in range(1, self._max_attempts + 1):
            try:
                result = self._apply(content)
            except (Conflict, NotFound) as exc:
                log.info("ResourceSlice changed while publishing (%s), re-reading", exc.status)
                error = exc
            except CountersDropped:
                log.warning(
                    "the API server dropped sharedCounters/consumesCounters from ResourceSlice writes "
                    "(feature gate DRAPartitionableDevices is off); publishing without partitionable MIG devices"
                )
                self._partitionable = False
                content = self._content()
                continue
            except SharesDropped:
                log.warning(
                    "the API server dropped allowMultipleAllocations from ResourceSlice writes (feature gate "
                    "DRAConsumableCapacity is off); publishing whole GPUs without consumable shares"
                )
                self._share_mode = None
                content = self._content()
                continue
            except ApiError as exc:
                if 0 < exc.status < 500 and exc.status != 429:  # a client error: retrying changes nothing
                    raise
                error = exc
                if attempt < self._max_attempts:  # after the last one, `run` decides when to try again
                    self._sleep(backoff.next())
            else:
                self._published, self._last = content, result
                return result
        raise error or ApiError(0, "gave up publishing ResourceSlices")

    def _apply(self, content: tuple[SliceContent, ...]) -> PublishResult:
        existing = {s["metadata"]["name"]: s for s in self._store.list(self.node_name, self.driver)}
        current = max((_generation(s) for s in existing.values()), default=self._generation)
        devices = sum(len(c.devices) for c in content)
        desired = self._slices(content, current)
        in_place = {n for n, body in desired.items() if n in existing and _same(body, existing[n])}
        if desired.keys() == existing.keys() == in_place:
            self._generation = current
            return PublishResult(devices, len(desired), current)

        # A pass cut short by a server error resumes its own generation: only the slices not yet written are
        # sent again, instead of the whole pool under a new generation on every retry. Only the process that
        # wrote that generation resumes it, for the same content and owner; any other change bumps it.
        resuming = current == self._generation > 0 and self._writing == (content, self._node_uid)
        generation = current if resuming else max(current, self._generation) + 1
        created = updated = deleted = 0
        for name, body in (desired if resuming else self._slices(content, generation)).items():
            if resuming and name in in_place:
                continue
            if name in existing:
                body["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                stored = self._store.replace(body)
                updated += 1
            else:
                stored = self._store.create(body)
                created += 1
            self._generation = generation  # written at least once: never reused for other content
            self._writing = (content, self._node_uid)
            _check_counters_kept(body, stored)
        for name in existing.keys() - desired.keys():
            self._store.delete(name)
            deleted += 1
        self._writing = None
        log.info(
            "published ResourceSlices for pool %s generation %d: %d devices, %d created, %d updated, %d deleted",
            self.node_name,
            generation,
            devices,
            created,
            updated,
            deleted,
        )
        return PublishResult(devices, len(desired), generation, created, updated, deleted)

    def _slices(self, content: tuple[SliceContent, ...], generation: int) -> dict[str, Json]:
        if not self._owner_known and self._rest is not None:
            self._node_uid = nodes.node_uid(self._rest, self.node_name)
            self._owner_known = True
        objs = resource_slices(
            content, node_name=self.node_name, driver=self.driver, generation=generation, node_uid=self._node_uid
        )
        return {o["metadata"]["name"]: o for o in objs}


def _same(desired: Json, existing: Json) -> bool:
    return _canonical(desired["spec"]) == _canonical(existing["spec"]) and _owners(desired) == _owners(existing)


def _owners(obj: Json) -> list[tuple[str, str]]:
    return [(str(r.get("kind")), str(r.get("uid"))) for r in obj.get("metadata", {}).get("ownerReferences") or []]


def _generation(obj: Json) -> int:
    return int(obj.get("spec", {}).get("pool", {}).get("generation") or 0)


def _check_counters_kept(sent: Json, stored: Json) -> None:
    def counted(obj: Json) -> tuple[bool, int]:
        spec = obj.get("spec") or {}
        return bool(spec.get("sharedCounters")), sum(1 for d in spec.get("devices") or [] if d.get("consumesCounters"))

    if counted(sent) != counted(stored):
        raise CountersDropped

    def shared(obj: Json) -> int:
        return sum(1 for d in (obj.get("spec") or {}).get("devices") or [] if d.get("allowMultipleAllocations"))

    if shared(sent) != shared(stored):
        raise SharesDropped


def _prune(value: Any) -> Any:
    """Drop unset fields: the server omits empty lists, maps and nulls that we may send."""
    if isinstance(value, dict):
        pruned = {k: _prune(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in (None, {}, [], False)}
    if isinstance(value, list):
        return [_prune(v) for v in value]
    return value


def _canonical(spec: Json) -> Json:
    """A spec in a form where equal meaning compares equal: quantities become numbers.

    `_prune` rebuilds every dict and list, so the numbers are written into a copy, never into `spec`.
    """
    spec = _prune(spec)

    def numbers(values: dict[str, Any]) -> None:
        for v in values.values():
            v["value"] = quantity.parse(str(v["value"]))

    for device in spec.get("devices", []):
        numbers(device.get("capacity", {}))
        for capacity in device.get("capacity", {}).values():
            if "requestPolicy" in capacity:  # exact values, validValues too
                capacity["requestPolicy"] = Policy.from_json(capacity["requestPolicy"])
        for taint in device.get("taints", []):  # RFC 3339 either way: "...Z" or "...+00:00" (the client's)
            if (at := parse_rfc3339(taint.get("timeAdded"))) is not None:
                taint["timeAdded"] = at
        for use in device.get("consumesCounters", []):
            numbers(use.get("counters", {}))
    for counter_set in spec.get("sharedCounters", []):
        numbers(counter_set.get("counters", {}))
    return spec
