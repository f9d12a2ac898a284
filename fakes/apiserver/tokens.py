"""Service-account tokens as kube-apiserver issues and reviews them, for the node agents' TokenReview.

TokenRequest (POST /api/v1/namespaces/NS/serviceaccounts/SA/token) mints an opaque token for that
ServiceAccount, for the audiences asked (the API server's own when none) and `expirationSeconds` (default an
hour, at least 600 as kube-apiserver requires). TokenReview (POST /apis/authentication.k8s.io/v1/tokenreviews)
answers as kube-apiserver does: `authenticated` with the user `system:serviceaccount:NS:SA` and the audiences
the token and spec.audiences share, or not authenticated with an error. Deleting the ServiceAccount does not
revoke its tokens here (kube-apiserver would); `revoke` ends one, as deleting the pod it is bound to would.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from agent.times import rfc3339

from .errors import ApiError

API_AUDIENCE = "https://kubernetes.default.svc"  # the control plane's --service-account-issuer
MIN_EXPIRATION_S = 600
DEFAULT_EXPIRATION_S = 3600


@dataclass(frozen=True)
class _Issued:
    username: str
    uid: str
    audiences: tuple[str, ...]
    expires: float


class Tokens:
    def __init__(self) -> None:
        self._issued: dict[str, _Issued] = {}
        self._lock = threading.Lock()

    def request(self, account: dict[str, Any], body: dict[str, Any] | None) -> dict[str, Any]:
        spec = dict((body or {}).get("spec") or {})
        seconds = int(spec.get("expirationSeconds") or DEFAULT_EXPIRATION_S)
        if seconds < MIN_EXPIRATION_S:
            raise ApiError(
                422,
                f"TokenRequest.authentication.k8s.io is invalid: spec.expirationSeconds: Invalid "
                f"value: {seconds}: may not specify a duration less than 10 minutes",
            )
        audiences = tuple(spec.get("audiences") or (API_AUDIENCE,))
        meta = account["metadata"]
        token = secrets.token_urlsafe(32)
        expires = time.time() + seconds
        with self._lock:
            self._issued[token] = _Issued(
                f"system:serviceaccount:{meta['namespace']}:{meta['name']}",
                str(meta.get("uid") or ""),
                audiences,
                expires,
            )
        spec["audiences"], spec["expirationSeconds"] = list(audiences), seconds
        return {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
            "spec": spec,
            "status": {"token": token, "expirationTimestamp": rfc3339(expires)},
        }

    def revoke(self, token: str) -> None:
        with self._lock:
            self._issued.pop(token, None)

    def review(self, body: dict[str, Any] | None) -> dict[str, Any]:
        spec = dict((body or {}).get("spec") or {})
        token = spec.get("token")
        if not isinstance(token, str) or not token:
            raise ApiError(422, "TokenReview.authentication.k8s.io is invalid: spec.token: Required value")
        wanted = tuple(spec.get("audiences") or (API_AUDIENCE,))
        with self._lock:
            issued = self._issued.get(token)
        status: dict[str, Any] = {"user": {}}  # kube-apiserver leaves out `authenticated: false`
        if issued is None:
            status["error"] = "invalid bearer token"
        elif issued.expires <= time.time():
            status["error"] = "[invalid bearer token, service account token has expired]"
        elif not (shared := [a for a in wanted if a in issued.audiences]):
            status["error"] = (
                f"[invalid bearer token, token audiences {json.dumps(list(issued.audiences))} is "
                f"invalid for the target audiences {json.dumps(list(wanted))}]"
            )
        else:
            namespace = issued.username.split(":")[2]
            status = {
                "authenticated": True,
                "audiences": shared,
                "user": {
                    "username": issued.username,
                    "uid": issued.uid,
                    "groups": ["system:serviceaccounts", f"system:serviceaccounts:{namespace}", "system:authenticated"],
                },
            }
        return {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "metadata": {},
            "spec": spec,
            "status": status,
        }
