"""The agent's own API error tree: what a failed call means, from the server's Status or from the network."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from urllib3.exceptions import HTTPError

from agent.kube.client import CredentialsError

T = TypeVar("T")


class ApiError(Exception):
    """An API call failed."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"API error {status}: {reason}")
        self.status = status
        self.reason = reason


class NotFound(ApiError):
    """404: the object does not exist."""


class Conflict(ApiError):
    """409: stale resourceVersion or the name is taken."""


class Gone(ApiError):
    """410: the watch's resourceVersion is too old."""


class Invalid(ApiError):
    """422: the object failed validation."""


class NotLeading(ApiError):
    """Refused before sending: this process may have lost its leader Lease (agent.kube.leader), so it writes
    nothing more."""


_BY_STATUS: dict[int, type[ApiError]] = {404: NotFound, 409: Conflict, 410: Gone, 422: Invalid}


def translate(status: int, body: bytes | str, reason: str = "") -> ApiError:
    """The error for an HTTP answer of `status` with `body` (a Status object, or anything a proxy sends)."""
    return _BY_STATUS.get(status, ApiError)(status, _message(body) or reason or "no reason given")


def _message(body: bytes | str) -> str:
    """The `message` of a Status body, which is what a person needs; the raw body when it is not one."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not body:
        return ""
    try:
        status = json.loads(body)
    except ValueError:
        return body
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return body


def call(fn: Callable[[], T]) -> T:
    """Run one request, raising this module's errors for the network's: an unreachable or stalled server
    (urllib3 errors, timeouts, refused connections) or credentials that cannot be had are status 0."""
    try:
        return fn()
    except CredentialsError as exc:
        raise ApiError(0, f"no credentials for the API server: {exc}") from exc
    except (HTTPError, OSError) as exc:
        raise ApiError(0, f"cannot reach the API server: {exc}") from exc
