"""Who may call a node's reservation API: the arbiter's service account, as the API server vouches for it.

The arbiter sends its projected service-account token (audience RESERVATION_AUDIENCE, rotated by kubelet): `TokenFile`
reads the file anew whenever it changes, so a rotated token is used at the next call, with no restart. The
node agent asks the API server about each token it has not seen lately (`TokenReviewer`: a TokenReview with
spec.audiences, the way kube-apiserver checks webhook tokens), accepts only the arbiter's service account,
and remembers answers for a short while in a bounded cache, so a Reserve costs no API round trip.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.kube.errors import ApiError
from agent.kube.rest import Resource, Rest
from agent.names import ARBITER_USER, RESERVATION_AUDIENCE
from agent.reservation.protocol import NodeUnavailable, Unauthenticated

AUDIENCE = RESERVATION_AUDIENCE
TOKEN_REVIEWS = Resource("authentication.k8s.io", "v1", "tokenreviews", False)
ACCEPTED_TTL_S = 30.0  # a token accepted this long ago is accepted without asking again
REFUSED_TTL_S = 5.0  # a refused one is refused without asking again (a caller retrying costs no reviews)
CACHE_ENTRIES = 256


class TokenFileError(ValueError):
    """The token file is missing, unreadable or empty."""


def read_token(path: str | Path) -> str:
    """The bearer token in a file: its content without surrounding whitespace; never empty."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise TokenFileError(f"cannot read the reservation token file {path}: {e.strerror or e}") from e
    if not token:
        raise TokenFileError(f"the reservation token file {path} is empty: anonymous reservations are not allowed")
    return token


class TokenFile:
    """The arbiter's token, read again whenever the file changes (kubelet swaps a projected token's file for a
    new one well before it expires): call it for each request. A failed read raises TokenFileError; the last
    token is not kept past a change, since the file changed because that token is going."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None  # (inode, mtime ns, size) of the file last read
        self._token = ""
        self.reads = 0

    def __call__(self) -> str:
        try:
            st = os.stat(self.path)  # follows kubelet's ..data symlink: a new token is a new inode
        except OSError as e:
            raise TokenFileError(f"cannot read the reservation token file {self.path}: {e.strerror or e}") from e
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            if seen != self._seen:
                self._token = read_token(self.path)
                self._seen = seen
                self.reads += 1
            return self._token


class TokenReviewer:
    """An Authenticator (agent.reservation.protocol): a bearer token is accepted when the API server says it is
    valid for `audience` and names `username`. Answers are cached by the token's SHA-256 (accepted for
    ACCEPTED_TTL_S, refused for REFUSED_TTL_S, at most CACHE_ENTRIES, oldest out first); a TokenReview that
    fails (the API server unreachable, or refusing us) is not cached and raises NodeUnavailable."""

    def __init__(
        self,
        rest: Rest,
        *,
        audience: str = AUDIENCE,
        username: str = ARBITER_USER,
        accepted_ttl_s: float = ACCEPTED_TTL_S,
        refused_ttl_s: float = REFUSED_TTL_S,
        entries: int = CACHE_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rest = rest
        self.audience = audience
        self.username = username
        self._ttl = (accepted_ttl_s, refused_ttl_s)
        self._entries = entries
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, tuple[float, str]] = OrderedDict()  # sha256 -> (until, "" or why refused)
        self.reviews = 0  # TokenReviews sent

    def authenticate(self, bearer: str | None) -> None:
        if not bearer:
            raise Unauthenticated("no bearer token: the arbiter sends its service-account token")
        key = hashlib.sha256(bearer.encode()).digest()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[0] > now:
                self._cache.move_to_end(key)
                refused = hit[1]
            else:
                hit = None
        if hit is None:
            refused = self._review(bearer)
            with self._lock:
                self._cache[key] = (now + self._ttl[bool(refused)], refused)
                self._cache.move_to_end(key)
                while len(self._cache) > self._entries:
                    self._cache.popitem(last=False)
        if refused:
            raise Unauthenticated(refused)

    def _review(self, token: str) -> str:
        """ "" when the token is the arbiter's for our audience, otherwise why not."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]},
        }
        with self._lock:
            self.reviews += 1
        try:
            status: dict[str, Any] = self._rest.create(TOKEN_REVIEWS, None, body).get("status") or {}
        except ApiError as e:
            raise NodeUnavailable(f"cannot check the caller's token: TokenReview failed: {e}") from e
        if not status.get("authenticated"):
            return f"the API server does not accept the token: {status.get('error') or 'not authenticated'}"
        if self.audience not in (status.get("audiences") or ()):
            return f"the token is not for audience {self.audience}"
        user = str((status.get("user") or {}).get("username") or "")
        if user != self.username:
            return f"{user or 'an unnamed user'} may not reserve devices here: only {self.username} may"
        return ""
