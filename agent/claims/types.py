"""What the kubelet plugin asks of claim preparation, and what it gets back (version-neutral)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ClaimRef:
    """A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    uid: str
    name: str


# A claim's UID names its CDI spec file and its checkpoint record, so it must be one harmless path component:
# the API server's UIDs are UUIDs; this allows any token of letters, digits, '.', '_' and '-' that starts and
# ends alphanumeric (never '.' or '..'), short enough for every file name built from it.
MAX_UID = 128
_UID = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # a namespace: at most 63
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")  # a name: 253


def uid_problem(uid: str) -> str:
    """Why `uid` cannot be a claim UID here ("" when it can)."""
    if len(uid) > MAX_UID:
        return f"claim UID {uid[:32]!r}... is longer than {MAX_UID} characters"
    if not _UID.fullmatch(uid):
        return f"claim UID {uid!r} is not a UID (letters, digits, '.', '_', '-')"
    return ""


def ref_problem(ref: ClaimRef) -> str:
    """Why the kubelet's reference `ref` names no claim this agent can prepare ("" when it names one). Checked
    before the UID touches a path or the names an API URL."""
    missing = [field for field in ("namespace", "uid", "name") if not getattr(ref, field)]
    if missing:
        return f"claim {ref.namespace}/{ref.name} lacks {', '.join(missing)}"
    if problem := uid_problem(ref.uid):
        return problem
    if len(ref.namespace) > 63 or not _DNS_LABEL.fullmatch(ref.namespace):
        return f"claim namespace {ref.namespace[:64]!r} is not a namespace name (a DNS label)"
    if len(ref.name) > 253 or not _DNS_SUBDOMAIN.fullmatch(ref.name):
        return f"claim name {ref.name[:64]!r} is not a ResourceClaim name (a DNS subdomain)"
    return ""


def log_refusal(log: logging.Logger, action: str, ref: ClaimRef, error: str, elapsed: float | None = None) -> None:
    """One warning for a claim refused or failed, with its reason (the kubelet shows it too, but only on the
    pod); the names cut short, as a refused claim's may be anything."""
    namespace, name = ref.namespace[:64], ref.name[:64]
    fields: dict[str, object] = {"claim_uid": ref.uid[:MAX_UID], "claim_namespace": namespace, "claim_name": name}
    if elapsed is not None:
        fields["ms"] = round(elapsed * 1000, 1)
    log.warning("%s of claim %s/%s refused: %s", action, namespace, name, error, extra=fields)


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device made ready for a container: maps 1:1 to the DRA `Device` message."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]


@dataclass(frozen=True)
class PrepareResult:
    """One claim's outcome: its devices, or a non-empty error (the batch never fails for one claim)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""
    notices: tuple[tuple[str, str], ...] = ()  # (reason, message): what the user should know of a prepared claim


# Tells people of something on a claim, or on the Node for None: (claim, Event type, reason, message).
Notify = Callable[["ClaimRef | None", str, str, str], None]


class Preparer(Protocol):
    """Prepares and unprepares claims; implemented by agent.claims, called by agent.kubelet.

    The claims it is given are screened, once, at the kubelet edge (agent.kubelet.dra): each names a claim
    (`ref_problem` finds nothing) and each uid comes once.
    """

    def prepare(self, claims: Sequence[ClaimRef], timeout: float | None = None) -> dict[str, PrepareResult]:
        """Result per claim uid, within `timeout` seconds where it can (the gRPC call's deadline)."""
        ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        """Error per claim uid; "" when unprepared (an unknown claim counts as unprepared)."""
        ...
