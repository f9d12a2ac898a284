"""What a person does with kubectl, as plain JSON over HTTP: create objects, read them, list them.

Not the kubernetes client: only agent.kube may import it, and the demo wants nothing beyond these calls.
"""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request

from agent.jsontypes import Json

# kind -> (API path prefix, plural, namespaced) for what the demo touches.
_RESOURCES = {
    "Node": ("/api/v1", "nodes", False),
    "DeviceClass": ("/apis/resource.k8s.io/v1", "deviceclasses", False),
    "ResourceSlice": ("/apis/resource.k8s.io/v1", "resourceslices", False),
    "ResourceClaim": ("/apis/resource.k8s.io/v1", "resourceclaims", True),
    "Event": ("/api/v1", "events", True),
    "Pod": ("/api/v1", "pods", True),
}


class KubectlError(RuntimeError):
    """The API server refused a request; the message carries its status and reason."""


class Kubectl:
    def __init__(self, url: str, timeout: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise KubectlError(f"API server URL {url!r} is not http(s)")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def create(self, body: Json) -> Json:
        namespace = body.get("metadata", {}).get("namespace", "default")
        return self._request("POST", self._path(body["kind"], namespace), body)

    def get(self, kind: str, name: str, namespace: str = "default") -> Json:
        return self._request("GET", f"{self._path(kind, namespace)}/{urllib.parse.quote(name)}")

    def label(self, kind: str, name: str, labels: dict[str, str], namespace: str = "default") -> Json:
        """`kubectl label --overwrite`: a JSON merge patch of the labels alone."""
        path = f"{self._path(kind, namespace)}/{urllib.parse.quote(name)}"
        return self._request("PATCH", path, {"metadata": {"labels": labels}}, "application/merge-patch+json")

    def list(self, kind: str, namespace: str = "default", field_selector: str = "") -> list[Json]:
        query = f"?fieldSelector={urllib.parse.quote(field_selector)}" if field_selector else ""
        items: list[Json] = self._request("GET", self._path(kind, namespace) + query).get("items") or []
        return items

    @staticmethod
    def _path(kind: str, namespace: str) -> str:
        if kind not in _RESOURCES:
            raise KubectlError(f"the demo does not handle kind {kind!r}")
        prefix, plural, namespaced = _RESOURCES[kind]
        return f"{prefix}/namespaces/{namespace}/{plural}" if namespaced else f"{prefix}/{plural}"

    def _request(
        self, method: str, path: str, body: Json | None = None, content_type: str = "application/json"
    ) -> Json:
        data = None if body is None else json.dumps(body).encode()
        # The scheme is checked in __init__: only http(s) reaches urlopen.
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                result: Json = json.loads(response.read())
                return result
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")
            with contextlib.suppress(ValueError):
                detail = json.loads(detail).get("message", detail)
            raise KubectlError(f"{method} {path}: {e.code} {detail}") from None
