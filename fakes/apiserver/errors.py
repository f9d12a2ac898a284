"""API errors as the real server reports them: a `Status` object with reason, code and details."""

from __future__ import annotations

from typing import Any

REASONS = {
    400: "BadRequest",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
}


class ApiError(Exception):
    """A request failed; `status()` is the body the client receives."""

    def __init__(
        self,
        code: int,
        message: str,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _about(group: str, plural: str, name: str) -> tuple[str, dict[str, Any]]:
    """How messages name one object (`pods "p"`, `resourceclaims.resource.k8s.io "c"`), and the details."""
    what = f"{plural}.{group}" if group else plural
    return f'{what} "{name}"', {"name": name, "group": group, "kind": plural}


def not_found(group: str, plural: str, name: str) -> ApiError:
    what, details = _about(group, plural, name)
    return ApiError(404, f"{what} not found", details=details)


def already_exists(group: str, plural: str, name: str) -> ApiError:
    what, details = _about(group, plural, name)
    return ApiError(409, f"{what} already exists", reason="AlreadyExists", details=details)


def conflict(group: str, plural: str, name: str, why: str) -> ApiError:
    what, details = _about(group, plural, name)
    return ApiError(409, f"Operation cannot be fulfilled on {what}: {why}", details=details)


def invalid(group: str, kind: str, name: str, causes: list[tuple[str, str]]) -> ApiError:
    """422 with one cause per (field, message), worded like the real server."""
    text = "; ".join(f"{field}: {msg}" if field else msg for field, msg in causes)
    return ApiError(
        422,
        f'{kind}.{group or "core"} "{name}" is invalid: {text}',
        details={
            "name": name,
            "group": group,
            "kind": kind,
            "causes": [{"reason": "FieldValueInvalid", "message": m, "field": f} for f, m in causes],
        },
    )


def expired(message: str) -> ApiError:
    return ApiError(410, message, reason="Expired")
