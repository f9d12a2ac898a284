"""Committing an admitted gang through the nodes and the API, whole or not at all.

1. Reserve: each member claim on the node the arbiter chose (the node's local allocator picks the devices).
2. Write each claim as kube-scheduler's DRA plugin does in PreBind: first the finalizer
   `resource.kubernetes.io/delete-protection` (metadata update) unless the claim was created with it (the
   arbiter overlay's claim-protection policy), then `status.allocation` (results, nodeSelector for that
   node) together with `reservedFor` (the pod), every write conditional on the resourceVersion read.
3. Confirm every reservation: a node that let one expire meanwhile may have given its devices away.
4. Ungate each pod: its required node affinity narrowed to its node (the only change a gated pod's affinity
   allows), the arbiter's gate removed, the admission time annotated. Meanwhile mark the gang's PodGroup
   scheduled (condition `PodGroupInitiallyScheduled`, worded as kube-scheduler words it): in 1.37
   kube-scheduler schedules a PodGroup's ungated pods as one group and writes that condition inside its
   scheduling loop, one API round trip per group before it takes up the next; finding it written, it writes
   nothing and goes on.

Any failure before step 4 deallocates the claims written and releases every reservation: no partial gang
holds devices, in the API or on a node. Once every claim is written and confirmed the gang is committed;
a failure while ungating is finished by the next cycle (`recover`), which completes gangs whose gated pods
all hold their claims and rolls back the others (a crash between steps 2 and 4).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from agent.allocation.allocator import Claim
from agent.allocation.capacity import CapacitySummary
from agent.arbiter.domains import is_channel_claim
from agent.arbiter.world import Gang, Member
from agent.devices.names import InvalidDeviceName
from agent.devices.shares import Capacity
from agent.jsontypes import Json
from agent.kube.errors import ApiError, Conflict, NotFound
from agent.kube.rest import POD_GROUPS, PODS, RESOURCE_CLAIMS, STRATEGIC_MERGE_PATCH, Resource, Rest
from agent.names import ADMITTED_ANNOTATION, DELETE_PROTECTION, GATE
from agent.objects.read import ShareDevices, allocated_node, is_allocated, is_gated, meta, reserved_for
from agent.objects.write import Unsupported, allocation_status, reservation_claim
from agent.reservation.protocol import (
    GangCoordinator,
    MemberInvalid,
    MemberPlacement,
    NodeClient,
    Reservation,
    Unauthenticated,
    UnknownReservation,
)
from agent.times import rfc3339

log = logging.getLogger(__name__)

Write = tuple[Resource, str, str, str]  # what was written: (resource, namespace, name, resourceVersion)
_Mark = tuple[float, float]  # (time.perf_counter(), time.thread_time()): a step's start
T = TypeVar("T")

SCHEDULED = "PodGroupInitiallyScheduled"  # kube-scheduler's PodGroup condition, True once the group was placed


@dataclass
class Outcome:
    committed: bool
    reason: str = ""
    writes: list[Write] = field(default_factory=list)
    # the claim a node refused as written (a selector that does not compile, fails or costs too much) and the
    # node's words: the claim's error, not the node's, so it waits until the claim changes
    refused: tuple[Json, str] | None = None


class InvalidClaim(ValueError):
    """A node refused a Reserve for what the claim asks (INVALID_ARGUMENT): trying again cannot help."""


class ClaimRefused(Exception):
    """A Reserve refused for what its claim asks; `member` names the reservation member (pod key/claim)."""

    def __init__(self, member: str, node: str, message: str) -> None:
        super().__init__(f"node {node} refused claim {member}: {message}")
        self.member, self.node, self.message = member, node, message


class _ClaimErrors:
    """A node's client whose Reserve raises ClaimRefused, naming the member, for a request the node called
    invalid (a ValueError: InvalidClaim over gRPC, MemberInvalid for a batch); a device name the node answered
    badly is the node's fault."""

    def __init__(self, node: str, client: NodeClient) -> None:
        self._node, self._client = node, client

    def reserve(self, gang_id: str, member: str, claim: Claim, ttl_seconds: float) -> Reservation:
        try:
            return self._client.reserve(gang_id, member, claim, ttl_seconds)
        except InvalidDeviceName:
            raise
        except ValueError as e:
            raise ClaimRefused(member, self._node, str(e)) from e

    def reserve_many(self, gang_id: str, members: Sequence[tuple[str, Claim]], ttl_seconds: float) -> list[Reservation]:
        try:
            return self._client.reserve_many(gang_id, members, ttl_seconds)
        except MemberInvalid as e:
            raise ClaimRefused(e.member, self._node, str(e)) from e

    def confirm(self, reservation_id: str) -> Reservation:
        return self._client.confirm(reservation_id)

    def confirm_many(self, reservation_ids: Sequence[str]) -> list[Reservation]:
        return self._client.confirm_many(reservation_ids)

    def release(self, reservation_id: str = "", gang_id: str = "") -> int:
        return self._client.release(reservation_id, gang_id)

    def capacity(self) -> CapacitySummary:
        return self._client.capacity()


def narrowed(pod: Json, node: str, now: float) -> Json:
    """The pod ungated for `node`: each required node-affinity term gains `metadata.name In [node]` (or one
    such term is added), the arbiter's gate is removed and the admission time annotated."""
    out = json_copy(pod)
    spec = out["spec"]
    field_req = {"key": "metadata.name", "operator": "In", "values": [node]}
    required = (
        spec.setdefault("affinity", {})
        .setdefault("nodeAffinity", {})
        .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    )
    terms = required.get("nodeSelectorTerms") or []
    if not terms:
        terms = [{}]
    for term in terms:
        fields = term.setdefault("matchFields", [])
        if field_req not in fields:
            fields.append(field_req)
    required["nodeSelectorTerms"] = terms
    spec["schedulingGates"] = [g for g in spec.get("schedulingGates") or () if g.get("name") != GATE]
    if not spec["schedulingGates"]:
        del spec["schedulingGates"]
    # To the millisecond: it is compared with times within the same second (evict.same_burst).
    out["metadata"].setdefault("annotations", {})[ADMITTED_ANNOTATION] = rfc3339(now, 3)
    return out


def json_copy(obj: Json) -> Json:
    """A deep copy of an API object (JSON values only) to edit before writing it: through orjson, a pod costs
    about 10 us against 300 us for copy.deepcopy, which was a quarter of the commit threads' CPU."""
    out: Json = orjson.loads(orjson.dumps(obj))
    return out


class Committer:
    def __init__(
        self,
        rest: Rest,
        driver: str,
        clients: Callable[[], Mapping[str, NodeClient]],
        *,
        ttl_seconds: float,
        clock: Callable[[], float],
    ) -> None:
        self._rest = rest
        self._driver = driver
        self._clients = clients
        self._ttl = ttl_seconds
        self._clock = clock
        # the gangs the last recovery found nothing to do for: the same Gang object (the snapshot keeps a gang none
        # of whose pods and claims changed) needs nothing again, and a cycle need not walk every pod of the cluster
        self._settled: dict[str, Gang] = {}
        self.timings: dict[str, float] = {}  # seconds per step over all commits (summed over parallel commits)
        # CPU seconds per step: a commit's own thread's (with the writes it makes itself), and the I/O threads'
        # writes as steps of their own ("... (I/O threads)"), so that none is counted twice
        self.cpu_timings: dict[str, float] = {}
        self._io = futures.ThreadPoolExecutor(64, thread_name_prefix="commit-io")  # a gang's writes at once
        self._timings_lock = threading.Lock()

    def close(self) -> None:
        self._io.shutdown(wait=True)

    def _add(self, step: str, since: _Mark) -> _Mark:
        """Book the wall time and this thread's CPU since `since` to `step`; returns the mark of now."""
        now = _mark()
        with self._timings_lock:
            self.timings[step] = self.timings.get(step, 0.0) + now[0] - since[0]
            self.cpu_timings[step] = self.cpu_timings.get(step, 0.0) + now[1] - since[1]
        return now

    # -- commit ---------------------------------------------------------------------------------------

    def commit(
        self,
        gang_id: str,
        members: Sequence[tuple[Member, str]],
        classes: Mapping[str, Mapping[str, Any]],
        shareable: ShareDevices | None = None,
        pod_group: Json | None = None,
        *,
        decided_at: float | None = None,
    ) -> Outcome:
        """Reserve every member's claims on its node, write the allocations, confirm, ungate, marking `pod_group`
        (the gang's PodGroup, if it has one) scheduled meanwhile. `shareable`: the devices published for sharing
        (World.shareable), where a request for consumable capacity takes a share of a GPU: the node books its
        fraction, the claim records the share as kube-scheduler does."""
        shareable = shareable or {}
        placements: list[MemberPlacement] = []
        to_write: dict[str, tuple[Member, Json, str]] = {}  # reservation member -> (pod, claim, node)
        shared: list[tuple[Member, Json]] = []  # allocated already (by someone else): only reservedFor added
        on_node: dict[str, list[Mapping[str, Capacity]]] = {}  # node -> its shareable devices' capacities
        for _, node in members:
            on_node.setdefault(node, [])
        for (pool, _), caps in shareable.items():
            if pool in on_node:
                on_node[pool].append(caps)
        try:
            for member, node in members:
                for claim in member.claims:
                    if is_channel_claim(claim):
                        continue  # a ComputeDomain channel: kube-scheduler allocates it on the node given
                    if is_allocated(claim):
                        if not reserved_for(claim, member.pod):
                            shared.append((member, claim))
                        continue
                    name = f"{member.key}/{meta(claim).get('name')}"
                    choice = member.choices.get(str(meta(claim).get("name")))  # firstAvailable: as planned
                    req: Claim = reservation_claim(claim, on_node[node], choice)
                    placements.append(MemberPlacement(name, node, req))
                    to_write[name] = (member, claim, node)
        except Unsupported as e:
            return Outcome(False, f"unsupported claim: {e}")
        t = _mark()
        clients = self._clients()
        nodes = {p.node for p in placements} & clients.keys()  # a node without a client: refused as unknown
        coordinator = GangCoordinator({node: _ClaimErrors(node, clients[node]) for node in nodes})
        try:
            held, refused = coordinator.reserve_all(gang_id, placements, self._ttl)
            if refused is not None and refused.kind == "no-fit":
                # reservations of this gang left by an arbiter killed mid-commit hold devices until their TTL:
                # only one arbiter commits a gang at a time, so they are stale; free them and try once more
                for node in {p.node for p in placements}:
                    client = clients.get(node)
                    if client is not None:
                        try:
                            client.release(gang_id=gang_id)
                        except (OSError, Unauthenticated, UnknownReservation):
                            continue
                held, refused = coordinator.reserve_all(gang_id, placements, self._ttl)
        except ClaimRefused as e:  # what was reserved is released; the claim waits until it changes
            self._add("reserve", t)
            claim = to_write[e.member][1]
            return Outcome(
                False,
                f"node {e.node} refused ResourceClaim {_claim_key(claim)}: {e.message}",
                refused=(claim, e.message),
            )
        t = self._add("reserve", t)
        if refused is not None:
            return Outcome(False, refused.reason)
        outcome = Outcome(True)

        statuses: dict[str, Json] = {}
        try:
            for name, (member, claim, node) in to_write.items():
                devices = held[name][1].fit.devices
                choice = member.choices.get(str(meta(claim).get("name")))
                statuses[name] = {
                    "allocation": allocation_status(
                        claim,
                        node,
                        self._driver,
                        devices,
                        classes,
                        shareable=shareable,
                        share_id=_share_id,
                        choice=choice,
                    )
                }
        except Unsupported as e:  # the slice changed under the reservation: nothing was written yet
            coordinator.release_all(held)
            return Outcome(False, f"unsupported claim: {e}")

        def write(name: str) -> Json:
            member, claim, _ = to_write[name]
            return self._write_claim(claim, member.pod, statuses[name], outcome)

        # the members' claims at once (each claim's two writes stay in order): a gang's commit then takes the
        # time of one claim's writes, not of all of them in a row
        written, error = self._each(
            write, list(to_write), distinct=[_claim_key(c) for _, c, _ in to_write.values()], step="write claims"
        )
        try:
            if error is not None:
                raise error
            for member, claim in shared:  # one claim may be shared by several members: in order
                written.append(self._write_claim(claim, member.pod, {}, outcome))
        except ApiError as e:
            coordinator.release_all(held)
            self.deallocate(written, [m.pod for m, _ in members])
            return Outcome(False, f"writing claims failed: {e}")
        t = self._add("write claims", t)
        reason = coordinator.confirm_all(held)
        t = self._add("confirm", t)
        if reason:
            self.deallocate(written, [m.pod for m, _ in members])
            return Outcome(False, f"a node could not confirm: {reason}")
        # an ungated pod the arbiter caught stays as it is: its claims' nodeSelector leads kube-scheduler there
        gated = [(member, node) for member, node in members if is_gated(member.pod)]
        # the PodGroup marked while its pods are ungated: kube-scheduler's informers lag the writes, so the
        # mark is there before it takes the group up, as a rule (if not, it writes the mark itself)
        marking = (
            self._io.submit(self._booked, "mark scheduled (I/O threads)", self.mark_scheduled, pod_group)
            if pod_group is not None and gated
            else None
        )
        ungated, error = self._each(
            lambda mn: self.ungate(mn[0].pod, mn[1], decided_at),
            gated,
            distinct=[m.key for m, _ in gated],
            step="ungate",
        )
        if marking is not None:
            marking.result()
        outcome.writes.extend(ungated)
        if error is not None:  # committed: the next cycle's recovery ungates the rest
            log.warning("ungating a pod of %s failed (the next cycle retries): %s", gang_id, error)
        self._add("ungate", t)
        return outcome

    def mark_scheduled(self, pod_group: Json) -> None:
        """Write the condition kube-scheduler would write once it has placed the group, word for word (True,
        reason Scheduled, no message, this generation): equal to its own, it is not written again. Best effort:
        without it kube-scheduler writes it itself, only later."""
        m = meta(pod_group)
        condition = {
            "type": SCHEDULED,
            "status": "True",
            "reason": "Scheduled",
            "message": "",
            "observedGeneration": m.get("generation"),
        }
        held = scheduled_condition(pod_group)
        if held is not None and all(held.get(k) == v for k, v in condition.items()):
            return
        condition["lastTransitionTime"] = rfc3339(self._clock())
        try:  # a strategic merge: the conditions are merged by type, the others (DisruptionTarget) kept
            self._rest.patch(
                POD_GROUPS,
                str(m.get("namespace")),
                str(m.get("name")),
                {"status": {"conditions": [condition]}},
                content_type=STRATEGIC_MERGE_PATCH,
                subresource="status",
            )
        except ApiError as e:
            log.warning(
                "could not mark PodGroup %s/%s scheduled (kube-scheduler will): %s",
                m.get("namespace"),
                m.get("name"),
                e,
            )

    def _each(
        self, fn: Callable[[Any], Any], items: Sequence[Any], *, distinct: Sequence[str], step: str
    ) -> tuple[list[Any], ApiError | None]:
        """`fn` on every item, at once when the items touch distinct objects (else in order, on this thread); the
        results of those that succeeded and the first ApiError. The I/O threads' time is booked to `step`."""
        if len(items) < 2 or len(set(distinct)) < len(distinct):
            calls = [_call(fn, item) for item in items]
        else:
            calls = list(self._io.map(lambda item: self._booked(f"{step} (I/O threads)", _call, fn, item), items))
        results = [r for r, e in calls if e is None]
        errors = [e for _, e in calls if e is not None]
        return results, (errors[0] if errors else None)

    def _booked(self, step: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, its wall time and this thread's CPU booked to `step` (_add)."""
        since = _mark()
        try:
            return fn(*args)
        finally:
            self._add(step, since)

    def _write_claim(self, claim: Json, pod: Json, status: Json, outcome: Outcome) -> Json:
        """Finalizer, then allocation (when given) and reservedFor the pod; returns the claim as written."""
        current = claim
        finalizers = list(meta(current).get("finalizers") or ())
        if DELETE_PROTECTION not in finalizers:
            body = json_copy(current)
            body["metadata"]["finalizers"] = [*finalizers, DELETE_PROTECTION]
            body.setdefault("kind", "ResourceClaim")
            current = self._rest.replace(RESOURCE_CLAIMS, body)
            body = current  # the server's answer, ours alone: no copy needed
        else:
            body = json_copy(current)  # the informer's copy, shared
        body.setdefault("kind", "ResourceClaim")
        new_status = body.setdefault("status", {})
        new_status.update(status)
        pm = meta(pod)
        new_status["reservedFor"] = [
            *(new_status.get("reservedFor") or ()),
            {"resource": "pods", "name": pm.get("name"), "uid": pm.get("uid")},
        ]
        written = self._rest.replace(RESOURCE_CLAIMS, body, "status")
        m = meta(written)
        outcome.writes.append(
            (RESOURCE_CLAIMS, str(m.get("namespace")), str(m.get("name")), str(m.get("resourceVersion")))
        )
        return written

    # -- undo -----------------------------------------------------------------------------------------

    def deallocate(self, claims: Iterable[Json], pods: Iterable[Json]) -> list[Write]:
        """Take back what the arbiter wrote into these claims for these pods: drop the pods from reservedFor;
        a claim reserved for nobody else is deallocated and its finalizer removed (what kube-controller-manager
        does once the last consumer is gone). Best effort: a claim that changed meanwhile is left to the next
        cycle's recovery."""
        uids = {meta(p).get("uid") for p in pods}
        writes: list[Write] = []
        for claim in claims:
            m = meta(claim)
            ns, name = str(m.get("namespace")), str(m.get("name"))
            for _ in range(3):
                try:
                    fresh = self._rest.get(RESOURCE_CLAIMS, ns, name)
                    status = fresh.setdefault("status", {})
                    others = [r for r in status.get("reservedFor") or () if r.get("uid") not in uids]
                    status["reservedFor"] = others
                    if not others:
                        status.pop("allocation", None)
                    fresh.setdefault("kind", "ResourceClaim")
                    fresh = self._rest.replace(RESOURCE_CLAIMS, fresh, "status")
                    finalizers = list(meta(fresh).get("finalizers") or ())
                    if not others and DELETE_PROTECTION in finalizers:
                        fresh["metadata"]["finalizers"] = [f for f in finalizers if f != DELETE_PROTECTION]
                        fresh = self._rest.replace(RESOURCE_CLAIMS, fresh)
                    writes.append((RESOURCE_CLAIMS, ns, name, str(meta(fresh).get("resourceVersion"))))
                    break
                except Conflict:
                    continue
                except NotFound:
                    break
                except ApiError as e:
                    log.warning("could not deallocate claim %s/%s (recovery retries): %s", ns, name, e)
                    break
        return writes

    def ungate(self, pod: Json, node: str, decided_at: float | None = None) -> Write:
        """`decided_at`: the deciding cycle's time, annotated as the admission (else now): a gang first seen
        waiting after that cycle was not weighed by it, however long the commit took (evict.same_burst)."""
        m = meta(pod)
        ns, name = str(m.get("namespace")), str(m.get("name"))
        current = pod
        for attempt in range(3):
            body = narrowed(current, node, self._clock() if decided_at is None else decided_at)
            body.setdefault("kind", "Pod")
            try:
                written = self._rest.replace(PODS, body)
                return (PODS, ns, name, str(meta(written).get("resourceVersion")))
            except Conflict:
                if attempt == 2:
                    raise
                current = self._rest.get(PODS, ns, name)
                if not is_gated(current):
                    return (PODS, ns, name, str(meta(current).get("resourceVersion")))
        raise AssertionError("unreachable")

    def release_gate(self, pod: Json) -> Write:
        """Remove the arbiter's gate from a pod that is not the arbiter's (the admission policy gates every pod
        with claims; these have none of our classes), changing nothing else."""
        m = meta(pod)
        ns, name = str(m.get("namespace")), str(m.get("name"))
        body = json_copy(pod)
        body.setdefault("kind", "Pod")
        body["spec"]["schedulingGates"] = [
            g for g in body["spec"].get("schedulingGates") or () if g.get("name") != GATE
        ]
        written = self._rest.replace(PODS, body)
        return (PODS, ns, name, str(meta(written).get("resourceVersion")))

    # -- recovery -------------------------------------------------------------------------------------

    def _reserve_again(self, member: Member, claims: Sequence[Json]) -> list[Write]:
        """Put an admitted pod back in `reservedFor` of its claims that lost it (_unreserved)."""
        pod = member.pod
        given = Outcome(True)
        for claim in claims:
            try:
                self._write_claim(claim, pod, {}, given)
            except ApiError as e:  # changed meanwhile, or gone: the next cycle looks again
                log.warning("could not reserve claim %s again for %s: %s", _claim_key(claim), member.key, e)
                continue
            log.warning(
                "kube-scheduler took %s out of the reservedFor of claim %s (a failed binding attempt): put back",
                member.key,
                _claim_key(claim),
            )
        return given.writes

    def recover(self, gangs: Iterable[Gang]) -> tuple[list[Write], list[str]]:
        """Finish or undo commits a previous cycle (or leader) left half done. A gated pod whose claims are
        all allocated and reserved for it was committed; one holding only some was interrupted. A gang is
        completed (its committed pods ungated) when none of its pods was interrupted and its committed and
        running pods reach minCount; otherwise its committed claims are deallocated. Returns the writes
        and the gangs completed. Also gives back the reservations kube-scheduler took from admitted pods
        (`_reserve_again`)."""
        writes: list[Write] = []
        completed: list[str] = []
        settled: dict[str, Gang] = {}
        for gang in gangs:
            if self._settled.get(gang.name) is gang:
                settled[gang.name] = gang
                continue
            due = False  # a reservation to give back: looked at again next cycle, whatever this one wrote
            for member in gang.members.values():
                lost = _unreserved(member)
                if lost:
                    due = True
                    writes.extend(self._reserve_again(member, lost))
            gated = [m for m in gang.members.values() if is_gated(m.pod) and not meta(m.pod).get("deletionTimestamp")]
            holding = [(m, [c for c in m.claims if is_allocated(c) and reserved_for(c, m.pod)]) for m in gated]
            holding = [(m, held) for m, held in holding if held]
            if not holding:
                if not due:
                    settled[gang.name] = gang
                continue
            committed = [
                (m, held) for m, held in holding if len(held) == sum(1 for c in m.claims if not is_channel_claim(c))
            ]
            running = sum(1 for m in gang.members.values() if not is_gated(m.pod) and m.node is not None)
            nodes = {m.key: _node_of(held) for m, held in committed}
            if len(committed) == len(holding) and len(committed) + running >= gang.min_member and all(nodes.values()):
                for m, _ in committed:
                    try:
                        writes.append(self.ungate(m.pod, str(nodes[m.key])))
                    except ApiError as e:
                        log.warning("recovery could not ungate %s: %s", m.key, e)
                completed.append(gang.name)
                continue
            log.info("rolling back the interrupted commit of %s", gang.name)
            for m, held in holding:
                writes.extend(self.deallocate(held, [m.pod]))
        self._settled = settled
        return writes, completed


def _unreserved(member: Member) -> list[Json]:
    """The allocated claims of an admitted pod that kube-scheduler took it out of. After a failed binding attempt
    kube-scheduler's DRA Unreserve removes the pod from every allocated claim reserved for it, ours included;
    1.37 fails such attempts on its own when it tries a PodGroup before all its pods are ungated, and its next
    attempt was seen refused writing the reservation back (from a stale copy), the devices allocated to no one.
    So an admitted pod, ungated, unbound, not terminating, whose allocated claims are reserved for no one, gets
    the reservation its PreBind would write (Committer._reserve_again)."""
    pod = member.pod
    m = meta(pod)
    if (
        is_gated(pod)
        or (pod.get("spec") or {}).get("nodeName")
        or m.get("deletionTimestamp")
        or ADMITTED_ANNOTATION not in (m.get("annotations") or {})
    ):
        return []
    return [c for c in member.claims if is_allocated(c) and not (c.get("status") or {}).get("reservedFor")]


def scheduled_condition(pod_group: Json) -> Json | None:
    """The PodGroup's `PodGroupInitiallyScheduled` condition, if it has one."""
    return next(
        (c for c in (pod_group.get("status") or {}).get("conditions") or () if c.get("type") == SCHEDULED), None
    )


def _mark() -> _Mark:
    return time.perf_counter(), time.thread_time()


def _call(fn: Callable[[Any], Any], item: Any) -> tuple[Any, ApiError | None]:
    try:
        return fn(item), None
    except ApiError as e:
        return None, e


def _share_id() -> str:
    """A share's `shareID`: a fresh RFC 4122 uuid in lowercase, as kube-scheduler makes it."""
    return str(uuid.uuid4())


def _claim_key(claim: Json) -> str:
    return f"{meta(claim).get('namespace')}/{meta(claim).get('name')}"


def _node_of(claims: Sequence[Json]) -> str | None:
    nodes = {allocated_node(c) for c in claims}
    return nodes.pop() if len(nodes) == 1 else None
