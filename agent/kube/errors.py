"""The agent's own API error tree; the client's ApiException is kept as the cause."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

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


_BY_STATUS: dict[int, type[ApiError]] = {404: NotFound, 409: Conflict, 410: Gone, 422: Invalid}


def translate(exc: ApiException) -> ApiError:
    status = int(exc.status or 0)
    return _BY_STATUS.get(status, ApiError)(status, _message(exc.body) or str(exc.reason or "no reason given"))


def _message(body: object) -> str:
    """The `message` of a Status body, which is what a person needs; the raw body when it is not one."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    if not body:
        return ""
    try:
        status = json.loads(str(body))
    except ValueError:
        return str(body)
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return str(body)


def call(fn: Callable[[], T]) -> T:
    """Run one client call, raising this module's errors instead of the client's: an unreachable or
    stalled server (urllib3 errors, timeouts, refused connections) is an ApiError with status 0."""
    try:
        return fn()
    except ApiException as exc:
        raise translate(exc) from exc
    except (HTTPError, OSError) as exc:
        raise ApiError(0, f"cannot reach the API server: {exc}") from exc
