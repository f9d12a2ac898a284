"""The first steps of uninstalling one of our leader-elected controllers (the arbiter, the ComputeDomain
controller): delete its Deployment, then wait until no replica holds its Lease. A replica still running would
undo what the uninstall removes next, and `helm uninstall` deletes the controller's RBAC with the rest, so a
replica stopped only then cannot release its Lease: the next install would wait for it to lapse."""

from __future__ import annotations

import time
from collections.abc import Callable

from agent.jsontypes import Json
from agent.kube.errors import NotFound
from agent.kube.leader import HolderClock
from agent.kube.rest import LEASES, Resource, Rest

DEPLOYMENTS = Resource("apps", "v1", "deployments", True)


class StillRunning(Exception):
    """A replica still holds the Lease after its Deployment was deleted (one run outside the Deployment)."""


def delete(rest: Rest, resource: Resource, namespace: str | None, name: str) -> bool:
    """True when it was there; a resource the server does not serve is not there."""
    try:
        rest.delete(resource, namespace, name)
    except NotFound:
        return False
    return True


def stop_controller(
    rest: Rest,
    namespace: str,
    deployment: str,
    lease: str,
    *,
    wait_s: float,
    say: Callable[[str], None],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Delete the Deployment and wait, up to `wait_s`, until its Lease is free (released, lapsed or gone).
    Raises StillRunning when a holder keeps renewing it."""
    if delete(rest, DEPLOYMENTS, namespace, deployment):
        say(f"deleted Deployment {namespace}/{deployment}")
    holders = HolderClock()
    deadline = clock() + wait_s
    while True:
        try:
            record: Json | None = rest.get(LEASES, namespace, lease)
        except NotFound:
            record = None
        holder = holders.holding((record or {}).get("spec") or {}, clock())
        if holder is None:
            return
        if clock() >= deadline:
            raise StillRunning(
                f"{holder} still holds the Lease {namespace}/{lease} {wait_s:g} s after Deployment {deployment} "
                "was deleted; stop it, then run --uninstall again"
            )
        sleep(1.0)
