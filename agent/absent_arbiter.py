"""While no arbiter runs, the pods that wait for it are told so: by one node agent, in an Event on each pod.

The arbiter's gate and its fence (agent.arbiter.fence) stay when the arbiter stops or is deleted, and its pods
then wait with nothing said. The node agents run on every GPU node whatever the overlay, so each of them reads
the arbiter's Lease every `period_s`; while no arbiter holds it, the agent that holds a Lease of their own
(ABSENCE_LEASE, client-go's election by one attempt per period) lists the pods waiting for the arbiter and
tells each one, once, then again every REFRESH_S while it still waits (an Event lives an hour): why it waits,
since when no arbiter has renewed its Lease, and the two ways out. One writer, whatever the number of nodes.

Where neither the arbiter's Lease nor its fence exists, the arbiter is not installed: nothing is told, and
nothing more than those two reads is asked of the API server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent.jsontypes import Json
from agent.kube.errors import ApiError, NotFound
from agent.kube.events import EventRecorder
from agent.kube.leader import LeaderElector
from agent.kube.rest import DEVICE_TAINT_RULES, LEASES, PODS, RESOURCE_CLAIMS, Rest
from agent.names import COMPONENT, FENCE_RULE, GATE
from agent.objects.read import awaits_placement, claim_names, is_gated, meta, pod_key, wants_our_devices
from agent.times import parse_rfc3339, rfc3339

log = logging.getLogger(__name__)

ABSENCE_LEASE = "gpu-dra-agent-absent-arbiter"  # held by the one node agent that tells the waiting pods
REASON = "WaitingForArbiter"
REFRESH_S = 1800.0  # a pod still waiting is told again, before its Event expires (the API server's 1 h)
BATCH = 200  # pods told per period at most: a thousand waiting pods are told over five periods, not at once


def arbiter_absence(lease: Mapping[str, Any] | None, now: float, where: str) -> str | None:
    """Why no arbiter runs, in words, from its Lease as read (None: not found); None while one holds it.
    A Lease renewed within twice its duration counts as held (the clocks of two machines may differ)."""
    if lease is None:
        return f"the arbiter's Lease {where} does not exist (no arbiter runs, or it was removed)"
    spec = lease.get("spec") or {}
    renewed = parse_rfc3339(spec.get("renewTime"))
    duration = float(spec.get("leaseDurationSeconds") or 15)
    holder = str(spec.get("holderIdentity") or "")
    if holder and renewed is not None and now - renewed <= 2 * duration:
        return None
    if renewed is None:
        return f"no arbiter has renewed its Lease {where}"
    if not holder:
        return f"the last arbiter gave up its Lease {where} at {rfc3339(renewed)} and none has taken it since"
    return f"no arbiter has renewed its Lease {where} since {rfc3339(renewed)} (last held by {holder})"


def waiting_pods(pods: Iterable[Json], claims: Iterable[Json], *, fenced: bool) -> list[tuple[Json, str]]:
    """The pods that wait for the arbiter, each with how: gated (they carry its scheduling gate), or, while
    the fence stands, unbound and ungated with a claim of the driver's classes nobody allocated (kube-scheduler
    may not allocate it)."""
    by_key = {pod_key(c): c for c in claims}
    out: list[tuple[Json, str]] = []
    for pod in pods:
        if not awaits_placement(pod):
            continue
        if is_gated(pod):
            out.append((pod, f"it carries the scheduling gate {GATE}, which only the arbiter removes"))
            continue
        names, _ = claim_names(pod)
        found = [by_key.get(f"{meta(pod).get('namespace', '')}/{n}") for n in names]
        if fenced and wants_our_devices(found):
            out.append((pod, f"the DeviceTaintRule {FENCE_RULE} keeps kube-scheduler from allocating its claims"))
    return out


class AbsenceTeller:
    """One node agent's part: `check()` every period; tells only while it holds ABSENCE_LEASE."""

    def __init__(
        self,
        rest: Rest,
        namespace: str,
        identity: str,
        recorder: EventRecorder,
        *,
        period_s: float = 60.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._rest = rest
        self.namespace = namespace
        self.period_s = period_s
        self._clock = clock
        self._recorder = recorder
        self._elector = LeaderElector(
            rest,
            namespace,
            ABSENCE_LEASE,
            identity,
            lease_duration=3 * period_s,
            renew_deadline=2 * period_s,
            retry_period=period_s,
            clock=clock,
        )
        self._told: dict[str, tuple[str, float]] = {}  # pod uid -> (message, when told)

    def check(self) -> int:
        """One look; the number of pods told. API errors are logged and the next period tries again."""
        try:
            return self._check()
        except ApiError as exc:
            log.warning("could not check for an absent arbiter: %s", exc)
            return 0

    def _check(self) -> int:
        now = self._clock()
        where = f"{self.namespace}/{COMPONENT}"
        try:
            lease: Json | None = self._rest.get(LEASES, self.namespace, COMPONENT)
        except NotFound:
            lease = None
        absence = arbiter_absence(lease, now, where)
        if absence is None:
            self._told.clear()  # an arbiter runs: a later absence is told afresh
            return 0
        try:
            self._rest.get(DEVICE_TAINT_RULES, None, FENCE_RULE)
            fenced = True
        except NotFound:  # no fence, or no DeviceTaintRules served (before 1.37)
            fenced = False
        if lease is None and not fenced:
            return 0  # the arbiter is not installed
        if not self._elector.try_acquire_or_renew():
            return 0  # another node agent tells them
        pods = self._rest.list(PODS).get("items") or []
        claims = (self._rest.list(RESOURCE_CLAIMS).get("items") or []) if fenced else []
        told = 0
        waiting = waiting_pods(pods, claims, fenced=fenced)
        still = {str(meta(p).get("uid")) for p, _ in waiting}
        self._told = {uid: t for uid, t in self._told.items() if uid in still}
        for pod, how in waiting:
            uid = str(meta(pod).get("uid"))
            message = (
                f"waiting for the gpu-dra-agent queue arbiter: {absence}; {how}. Start the arbiter again "
                f"(Deployment gpu-dra-agent-arbiter), or hand these pods to kube-scheduler with "
                f'`gpu-dra-agent arbiter --uninstall` (README, "Running without the arbiter")'
            )
            before = self._told.get(uid)
            if before is not None and before[0] == message and now - before[1] < REFRESH_S:
                continue
            if told >= BATCH:
                break
            self._recorder.record(pod, "Pod", "v1", REASON, message, type_="Warning")
            self._told[uid] = (message, now)
            told += 1
        if told:
            log.warning("told %d pod(s) that they wait for an absent arbiter: %s", told, absence)
        return told

    def run(self, stop: threading.Event) -> None:
        while not stop.wait(self.period_s):
            self.check()
