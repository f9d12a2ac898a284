"""Uninstalling one of our leader-elected controllers (the arbiter, the ComputeDomain controller), as its
`--uninstall` does: delete its Deployment, wait until no replica holds its Lease, let go of what it held (each
controller says what: `Controller.release`), delete the Lease. A replica still running would undo the release, and
`helm uninstall` deletes the controller's RBAC with the rest, so a replica stopped only then cannot release its
Lease: the next install would wait for it to lapse. Every step can be run again."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from agent.jsontypes import Json
from agent.kube.errors import NotFound
from agent.kube.leader import HolderClock
from agent.kube.rest import LEASES, Resource, Rest

DEPLOYMENTS = Resource("apps", "v1", "deployments", True)


class StillRunning(Exception):
    """A replica still holds the Lease after its Deployment was deleted (one run outside the Deployment)."""


@dataclass(frozen=True)
class Controller:
    """A leader-elected controller as its uninstall sees it."""

    deployment: str
    lease: str
    # what it held, let go once no replica runs: says each step, returns the closing line
    release: Callable[[Rest, Callable[[str], None]], str]


def uninstall(
    rest: Rest,
    namespace: str,
    controller: Controller,
    *,
    wait_s: float = 60.0,
    say: Callable[[str], None] = print,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """The steps of the module doc, each said. Raises StillRunning when a replica keeps renewing the Lease for
    `wait_s` (nothing is released then), ApiError when the API server refuses a step."""
    if delete(rest, DEPLOYMENTS, namespace, controller.deployment):
        say(f"deleted Deployment {namespace}/{controller.deployment}")
    holders = HolderClock()
    deadline = clock() + wait_s
    while True:
        try:
            record: Json | None = rest.get(LEASES, namespace, controller.lease)
        except NotFound:
            record = None
        holder = holders.holding((record or {}).get("spec") or {}, clock())
        if holder is None:
            break
        if clock() >= deadline:
            raise StillRunning(
                f"{holder} still holds the Lease {namespace}/{controller.lease} {wait_s:g} s after Deployment "
                f"{controller.deployment} was deleted; stop it, then run --uninstall again"
            )
        sleep(1.0)
    closing = controller.release(rest, say)
    if delete(rest, LEASES, namespace, controller.lease):
        say(f"deleted Lease {namespace}/{controller.lease}")
    say(closing)


def delete(rest: Rest, resource: Resource, namespace: str | None, name: str) -> bool:
    """True when it was there; a resource the server does not serve is not there."""
    try:
        rest.delete(resource, namespace, name)
    except NotFound:
        return False
    return True
