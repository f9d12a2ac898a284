"""The HTTP front: URL routing, discovery, watch streaming, and the ApiServer object tests hold."""

from __future__ import annotations

import contextlib
import copy
import json
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from agent.kube.client import Client, Server
from agent.kube.rest import Rest

from . import openapi, protobuf, tables
from .api import APPLY, Api, WriteOptions, parse_json, parse_yaml
from .errors import ApiError
from .faults import Faults
from .resources import Registry, ResourceType
from .selectors import field_selector, label_selector
from .store import Event, Store, namespace_of
from .tokens import Tokens
from .versions import KubernetesVersion, default_version

_BODY_TYPES = (
    "application/json",
    "application/yaml",
    "application/json-patch+json",
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/apply-patch+yaml",
)
_PRESET_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


class _HttpServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up (a watch it closed, a process killed) is routine, as it is to a real API
        server: no traceback for it; anything else is still printed."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


class ApiServer:
    """An in-process Kubernetes API server on 127.0.0.1. Use as a context manager or call stop()."""

    def __init__(
        self,
        port: int = 0,
        *,
        kubernetes_version: str | None = None,
        feature_gates: dict[str, bool] | None = None,
        history: int = 1000,
        drop_partitionable_fields: bool = False,
        bookmark_interval: float = 1.0,
        max_watch_seconds: float = 1800.0,
        validate: bool = True,
    ) -> None:
        gates = dict(feature_gates or {})
        if drop_partitionable_fields:  # the older spelling of DRAPartitionableDevices=false
            gates["DRAPartitionableDevices"] = False
        self.version = KubernetesVersion(kubernetes_version or default_version(), gates)
        self.registry = Registry(self.version)
        self.store = Store(self.registry, history)
        self.api = Api(self.registry, self.store, self.version, validate=validate)
        self.faults = Faults()
        self.tokens = Tokens()  # service-account tokens: TokenRequest and TokenReview
        self._openapi_cache: dict[tuple[str, int], dict[str, Any]] = {}
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self.watch_epoch = 0  # bumped by drop_watches(); open watches notice and cut their connection
        self.stopping = False
        namespaces = self.registry.find("Namespace")
        for name in _PRESET_NAMESPACES:
            self.api.create(namespaces, "", {"metadata": {"name": name}})
        self._http = _HttpServer(("127.0.0.1", port), _Handler)
        self._http.daemon_threads = True
        self._http.block_on_close = False
        self._http.apiserver = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._http.serve_forever, name="fake-apiserver", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._http.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def register_custom(
        self,
        group: str,
        version: str,
        plural: str,
        kind: str,
        namespaced: bool = True,
        schema: dict[str, Any] | None = None,
        status: bool = True,
    ) -> ResourceType:
        """Serve a custom resource type, validated against `schema` (an openAPIV3Schema) when given."""
        return self.api.register_custom(group, version, plural, kind, namespaced, schema, status)

    def openapi_v3(self, group_version: str) -> dict[str, Any] | None:
        """The OpenAPI v3 document of 'api/v1' or 'apis/<group>/<version>', or None when not served."""
        key = (group_version, self.registry.generation)
        if key not in self._openapi_cache:
            types = [t for t in self.registry.all() if _gv_path(t) == group_version]
            if not types:
                return None
            self._openapi_cache[key] = openapi.group_version_document(
                self.version.version, types, f"v{self.version.version}.0"
            )
        return self._openapi_cache[key]

    def openapi_v3_hashes(self) -> dict[str, str]:
        return {
            gv: openapi.document_hash(doc)
            for gv in sorted({_gv_path(t) for t in self.registry.all()})
            if (doc := self.openapi_v3(gv)) is not None
        }

    def openapi_v2(self) -> dict[str, Any]:
        key = ("swagger", self.registry.generation)
        if key not in self._openapi_cache:
            self._openapi_cache[key] = openapi.swagger_document(
                self.version.version, self.registry.all(), f"v{self.version.version}.0"
            )
        return self._openapi_cache[key]

    def drop_watches(self) -> None:
        """Cut every open watch connection, as a restarting API server or a flaky network does."""
        with self.store.lock:
            self.watch_epoch += 1
            self.store.lock.notify_all()

    def kubeconfig(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
            "current-context": "fake",
        }

    def write_kubeconfig(self, path: str | Path) -> Path:
        out = Path(path)
        out.write_text(yaml.safe_dump(self.kubeconfig()))
        return out

    def rest(self) -> Rest:
        """The agent's own JSON client pointed at this server."""
        return Rest(Client(Server(self.url)))

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient pointed at this server (tests speak to it as third-party clients do)."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def stop(self) -> None:
        self.stopping = True
        self.drop_watches()
        self._http.shutdown()
        self._http.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> ApiServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start(port: int = 0, **options: Any) -> ApiServer:
    """Start a server; options are ApiServer's keyword arguments."""
    return ApiServer(port, **options)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-apiserver"

    @property
    def apiserver(self) -> ApiServer:
        return self.server.apiserver  # type: ignore[attr-defined,no-any-return]

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in one send, and small writes are not held back by Nagle's algorithm.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    # Plumbing.

    def _send(self, code: int, body: Any, content_type: str = "application/json") -> None:
        payload = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        warnings = "".join(f'Warning: 299 - "{_quoted(w)}"\r\n' for w in self._warnings)
        head = (
            f"HTTP/1.1 {code} {self.responses.get(code, ('',))[0]}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n{warnings}"
            f"Date: {self.date_time_string()}\r\n\r\n"
        ).encode()
        self.wfile.write(head + payload)
        self.log_request(code)

    def _answer(self, code: int, body: Any) -> None:
        """JSON, or protobuf where the client prefers it and the object's kind has a message (as kube-apiserver
        answers: Tables and custom resources stay JSON)."""
        if protobuf.accepts(self.headers.get("Accept") or "") and protobuf.encodable(body):
            self._send(code, protobuf.encode(body), protobuf.MEDIA_TYPE)
        else:
            self._send(code, body)

    def _serve(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        injected = self.apiserver.faults.check(method, url.path)
        self._warnings: list[str] = []
        self._shown: Callable[[dict[str, Any]], dict[str, Any]] | None = None  # watch events as Table rows
        try:
            if self.apiserver.faults.delay:
                time.sleep(self.apiserver.faults.delay)
            if injected is not None:
                self._send(injected.code, injected.status())
                return
            if raw and body_type == protobuf.MEDIA_TYPE and method in ("POST", "PUT", "DELETE"):
                # Built-in kinds as kubectl's typed clients send them; the rest of the fake reads JSON.
                raw = json.dumps(protobuf.decode(raw)).encode()
            elif raw and body_type and body_type not in _BODY_TYPES:
                # CBOR bodies (and protobuf patches, which kube-apiserver refuses too) are refused, never misread.
                accepted = (*_BODY_TYPES, protobuf.MEDIA_TYPE)
                unsupported = ApiError(
                    415,
                    f"the body of the request was in an unknown format - accepted media "
                    f"types include: {', '.join(accepted)}",
                )
                self._answer(unsupported.code, unsupported.status())
                return
            code, body = self._route(method, url.path, query, raw)
            if code:
                self._answer(code, body)
        except ApiError as exc:
            self._answer(exc.code, exc.status())
        except Exception as exc:  # a bug in the fake must reach the test as a 500, not a hung connection
            self._send(500, ApiError(500, f"fake apiserver error: {type(exc).__name__}: {exc}").status())

    def _route(self, method: str, path: str, query: dict[str, str], raw: bytes) -> tuple[int, Any]:
        parts = [urllib.parse.unquote(p) for p in path.strip("/").split("/") if p]
        registry = self.apiserver.registry
        if parts == ["version"]:
            return 200, self.apiserver.version.version_info()
        if parts in (["healthz"], ["livez"], ["readyz"]):
            return 200, "ok"
        if parts[:1] == ["openapi"]:
            return self._openapi(parts[1:])
        if parts == ["api"]:
            cidrs = [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.apiserver.url}]
            return 200, {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": cidrs}
        if parts == ["apis"]:
            return 200, {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [_group(g, vs) for g, vs in sorted(registry.groups().items())],
            }
        if method == "POST" and (
            parts == ["apis", "authentication.k8s.io", "v1", "tokenreviews"]
            or (
                parts[:3] == ["api", "v1", "namespaces"]
                and len(parts) == 7
                and parts[4:7:2] == ["serviceaccounts", "token"]
            )
        ):
            return self._tokens(parts, raw)
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 2:
            if len(parts) == 2:
                versions = registry.groups().get(parts[1])
                if not versions:
                    raise ApiError(404, f"the server could not find the requested resource ({path})")
                return 200, {"kind": "APIGroup", "apiVersion": "v1", **_group(parts[1], versions)}
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        types = [t for t in registry.all() if t.group == group and t.version == version]
        if not types:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        if not rest:
            gv = f"{group}/{version}" if group else version
            return 200, {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": gv,
                "resources": [r for t in types for r in t.discovery()],
            }
        by_plural = {t.plural: t for t in types}
        namespace: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in by_plural and by_plural[rest[2]].namespaced:
            namespace, rest = rest[1], rest[2:]
        rt = by_plural.get(rest[0])
        if rt is None or len(rest) > 3:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        name = rest[1] if len(rest) >= 2 else None
        sub = rest[2] if len(rest) == 3 else ""
        if sub and sub not in rt.subresources:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        ns = (namespace or "") if rt.namespaced else ""
        api = self.apiserver.api
        options = WriteOptions(
            query.get("fieldValidation") or "Warn",
            query.get("fieldManager") or "",
            bool(query.get("dryRun")),
            self.headers.get("User-Agent") or "",
            _flag(query, "force"),
        )
        self._warnings = options.warnings
        as_table = method == "GET" and tables.wants_table(self.headers.get("Accept") or "")
        include = query.get("includeObject") or "Metadata"
        if name is None:
            if method == "GET" and _flag(query, "watch"):
                self._watch(rt, namespace, query, as_table)
                return 0, None
            if method == "GET":
                listed = api.list_objects(rt, namespace if rt.namespaced else None, query)
                if as_table:
                    meta = {k: v for k, v in listed["metadata"].items() if k != "resourceVersion"}
                    return 200, tables.table(
                        rt,
                        listed["items"],
                        include=include,
                        list_meta=meta,
                        resource_version=listed["metadata"]["resourceVersion"],
                    )
                return 200, listed
            if method == "POST":
                if rt.namespaced and namespace is None:
                    raise ApiError(405, f"create {rt.plural} needs a namespace in the path")
                return 201, api.create(rt, ns, parse_json(raw), options)
            if method == "DELETE":
                return 200, self._delete_collection(rt, namespace, query, parse_json(raw))
            raise ApiError(405, f"{method} is not allowed on a collection")
        if rt.namespaced and namespace is None:
            raise ApiError(404, f"the server could not find the requested resource ({path})")
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()
        body = (parse_yaml(raw) if content_type == APPLY else parse_json(raw)) if raw else None
        if sub == "eviction" and method == "POST":
            return 201, api.evict(ns, name, body)
        if sub == "binding" and method == "POST":
            return 201, api.bind(ns, name, body)
        if method == "GET":
            found = api.get(rt, ns, name)
            if as_table and not sub:
                return 200, tables.table(
                    rt, [found], include=include, resource_version=found["metadata"].get("resourceVersion", "")
                )
            return 200, found
        if method == "PUT":
            return 200, api.update(rt, ns, name, body, sub, options)
        if method == "PATCH":
            existed = content_type != APPLY or api.exists(rt, ns, name)
            return (200 if existed else 201), api.patch(rt, ns, name, content_type, body, sub, options)
        if method == "DELETE" and not sub:
            return 200, api.delete(rt, ns, name, body)
        raise ApiError(405, f"{method} is not allowed on {path}")

    def _tokens(self, parts: list[str], raw: bytes) -> tuple[int, Any]:
        """TokenReview, or a TokenRequest for the ServiceAccount parts[5] in namespace parts[3]."""
        body = parse_json(raw) if raw else None
        if parts[1] == "authentication.k8s.io":
            return 201, self.apiserver.tokens.review(body)
        account = self.apiserver.api.get(self.apiserver.registry.find("ServiceAccount"), parts[3], parts[5])
        return 201, self.apiserver.tokens.request(account, body)

    def _openapi(self, parts: list[str]) -> tuple[int, Any]:
        server = self.apiserver
        if parts == ["v2"]:
            accept = self.headers.get("Accept") or ""
            if accept and "json" not in accept and "*/*" not in accept:
                raise ApiError(406, "only application/json is served for /openapi/v2", reason="NotAcceptable")
            return 200, server.openapi_v2()
        if parts == ["v3"]:
            return 200, {
                "paths": {
                    gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={digest}"}
                    for gv, digest in server.openapi_v3_hashes().items()
                }
            }
        document = server.openapi_v3("/".join(parts[1:])) if parts[:1] == ["v3"] else None
        if document is None:
            raise ApiError(404, f"the server could not find the requested resource (/openapi/{'/'.join(parts)})")
        return 200, document

    def _delete_collection(
        self, rt: ResourceType, namespace: str | None, query: dict[str, str], options: Any
    ) -> dict[str, Any]:
        listed = self.apiserver.api.list_objects(rt, namespace, query)
        for item in listed["items"]:
            meta = item["metadata"]
            try:
                self.apiserver.api.delete(rt, meta.get("namespace", ""), meta["name"], options)
            except ApiError as exc:
                if exc.code != 404:
                    raise
        return listed

    # Watch.

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        shown = self._shown
        if shown is not None and kind in ("ADDED", "MODIFIED", "DELETED"):
            obj = shown(obj)
        self._chunk(json.dumps({"type": kind, "object": obj}, separators=(",", ":")).encode() + b"\n")

    def _watch(self, rt: ResourceType, namespace: str | None, query: dict[str, str], as_table: bool = False) -> None:
        server = self.apiserver
        store = server.store
        include = query.get("includeObject") or "Metadata"
        self._shown = (lambda obj: tables.table(rt, [obj], include=include)) if as_table else None
        labels = label_selector(query.get("labelSelector"))
        fields = field_selector(query.get("fieldSelector"), rt.field_selectors)

        def matches(obj: dict[str, Any] | None) -> bool:
            return (
                obj is not None
                and (namespace is None or namespace_of(obj) == namespace)
                and labels(obj)
                and fields(obj)
            )

        timeout = min(float(query.get("timeoutSeconds") or server.max_watch_seconds), server.max_watch_seconds)
        bookmarks = _flag(query, "allowWatchBookmarks")
        initial_events = _flag(query, "sendInitialEvents")
        requested = query.get("resourceVersion") or ""
        try:
            since = int(requested) if requested else 0
        except ValueError:
            raise ApiError(400, f"invalid resourceVersion {requested!r}") from None
        expired: ApiError | None = None
        with store.lock:
            epoch = server.watch_epoch
            initial: list[dict[str, Any]] = []
            if since == 0 or initial_events:
                initial = copy.deepcopy([o for o in store.items(rt.key, namespace) if matches(o)])
                since = store.resource_version
            else:
                try:
                    store.events_after(since)
                except ApiError as exc:
                    expired = exc
        self.send_response_only(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if expired is not None:  # the real server answers 200 and then an ERROR event carrying 410
            self._event("ERROR", expired.status())
            self._end_stream()
            return
        for obj in initial:
            self._event("ADDED", obj)
        if initial_events and bookmarks:
            self._bookmark(rt, since, initial_end=True)
        deadline = time.monotonic() + timeout
        next_bookmark = time.monotonic() + server.bookmark_interval
        while True:
            with store.lock:
                events: list[Event] = []
                error: ApiError | None = None
                while not events and server.watch_epoch == epoch and time.monotonic() < deadline:
                    try:
                        events = [e for e in store.events_after(since) if e.key == rt.key]
                    except ApiError as exc:
                        error = exc
                        break
                    if events or (bookmarks and time.monotonic() >= next_bookmark):
                        break
                    since = store.resource_version  # events of other types are skipped for good
                    wake = min(deadline, next_bookmark if bookmarks else deadline)
                    store.lock.wait(max(0.0, wake - time.monotonic()))
                dropped = server.watch_epoch != epoch
                current = store.resource_version
            if dropped:
                self._cut()
                return
            if error is not None:
                self._event("ERROR", error.status())
                break
            for event in events:
                self._send_event(event, matches)
                since = event.rv
            if bookmarks and time.monotonic() >= next_bookmark:
                self._bookmark(rt, max(since, current) if not events else since)
                next_bookmark = time.monotonic() + server.bookmark_interval
            if time.monotonic() >= deadline:
                break
        self._end_stream()

    def _send_event(self, event: Event, matches: Any) -> None:
        now_matches, was_matching = matches(event.obj), matches(event.old)
        if event.type == "MODIFIED":
            if now_matches and not was_matching:
                self._event("ADDED", event.obj)
            elif was_matching and not now_matches:
                self._event("DELETED", event.obj)
            elif now_matches:
                self._event("MODIFIED", event.obj)
        elif now_matches:
            self._event(event.type, event.obj)

    def _bookmark(self, rt: ResourceType, rv: int, initial_end: bool = False) -> None:
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if initial_end:
            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
        self._event("BOOKMARK", {"kind": rt.kind, "apiVersion": rt.api_version, "metadata": meta})

    def _end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def _cut(self) -> None:
        """Drop the connection mid-stream, without the terminating chunk."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _quoted(text: str) -> str:
    """A Warning header's text as RFC 7234 quotes it (what client-go's warning parser unquotes)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _flag(query: dict[str, str], name: str) -> bool:
    """A boolean query parameter (watch, allowWatchBookmarks, sendInitialEvents) that is set to true."""
    return query.get(name) in ("1", "true", "True")


def _gv_path(rt: ResourceType) -> str:
    return f"apis/{rt.group}/{rt.version}" if rt.group else f"api/{rt.version}"


def _group(name: str, versions: list[str]) -> dict[str, Any]:
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}
