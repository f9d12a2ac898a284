"""Where the API server is and who we are to it: a kubeconfig file (its current context) when given, the pod's
service account otherwise.

A kubeconfig may name the server's CA and a client certificate by file (relative to the kubeconfig) or inline
(base64), a bearer token inline or by file, a user name and password, or an exec plugin
(client.authentication.k8s.io v1 or v1beta1: a token, refreshed when it expires or is refused, or a client
certificate, read once at start). Settings this client cannot honour are refused with a clear error, never
ignored: the legacy `auth-provider` plugins (kubectl itself dropped them for exec plugins), impersonation
(`as`, `as-uid`, `as-groups`, `as-user-extra`), `disable-compression` and an exec plugin's
`provideClusterInfo`. A proxy comes from the cluster's `proxy-url`, else from HTTPS_PROXY/HTTP_PROXY and
NO_PROXY as client-go reads them.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import ssl
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.kube.client import Auth, BearerToken, Client, CredentialsError, Server, StaticHeaders
from agent.kube.rest import Rest
from agent.times import parse_rfc3339

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
EXEC_TIMEOUT_S = 60.0


class KubeconfigError(CredentialsError):
    """No usable API client configuration; str() says which file or setting and why."""


def connect(kubeconfig: str | None = None) -> Rest:
    """JSON calls to the server of `kubeconfig`, or of the in-cluster service account; no request is made."""
    if not kubeconfig:
        try:
            return Rest(in_cluster())
        except KubeconfigError as exc:
            raise KubeconfigError(
                f"no kubeconfig given and the in-cluster configuration is not usable ({exc}); "
                "pass --kubeconfig or set KUBECONFIG when running outside a cluster"
            ) from None
    # KUBECONFIG may list several files, merged as kubectl does; a missing one in a list is skipped
    present = [Path(p) for p in kubeconfig.split(os.pathsep) if p and Path(p).exists()]
    if not present:
        raise KubeconfigError(f"kubeconfig {kubeconfig} does not exist")
    for path in present:
        if not path.is_file():
            raise KubeconfigError(f"kubeconfig {path} is not a file")
    try:
        return Rest(from_files(present))
    except (KubeconfigError, OSError, ValueError, yaml.YAMLError, ssl.SSLError) as exc:
        raise KubeconfigError(f"kubeconfig {kubeconfig} is not usable: {exc}") from None


def in_cluster(root: Path = SERVICE_ACCOUNT, env: Mapping[str, str] = os.environ) -> Client:
    """The API server as a pod sees it: the service's address from the environment, the service account's CA
    and token (read again every minute: a projected token is rotated in place)."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise KubeconfigError("KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set")
    token_file, ca_file = root / "token", root / "ca.crt"
    for needed in (token_file, ca_file):
        if not needed.is_file():
            raise KubeconfigError(f"{needed} does not exist")
    host = f"[{host}]" if ":" in host else host
    context = ssl.create_default_context(cafile=str(ca_file))
    url = f"https://{host}:{port}"
    return Client(
        Server(url, context, proxy_url=proxy_from_environment(url, env)),
        BearerToken(lambda: (_read_token(token_file), None)),
    )


def proxy_from_environment(url: str, env: Mapping[str, str] = os.environ) -> str | None:
    """The proxy client-go would use for `url`: HTTPS_PROXY (or HTTP_PROXY for http) in either case, unless
    NO_PROXY names the host (a domain suffix, an address, a CIDR range, or *)."""
    proxies = {k.lower(): v for k, v in env.items() if k.lower() in ("https_proxy", "http_proxy", "no_proxy") and v}
    scheme, _, rest = url.partition("://")
    proxy = proxies.get(f"{scheme}_proxy")
    if not proxy:
        return None
    host = rest.split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    if _bypassed(host, proxies.get("no_proxy", "")):
        return None
    return proxy if "://" in proxy else f"http://{proxy}"


def _bypassed(host: str, no_proxy: str) -> bool:
    """NO_PROXY as Go's httpproxy reads it: `*`; an address or CIDR range; `example.com` (it and its
    subdomains) or `.example.com` (subdomains only); a `:port` on an entry is ignored here (one server)."""
    try:
        address: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(host)
    except ValueError:
        address = None
    host = host.lower().rstrip(".")
    for entry in (e.strip().lower() for e in no_proxy.split(",")):
        if entry == "*":
            return True
        if not entry:
            continue
        if address is not None:
            try:
                if address in ipaddress.ip_network(entry.strip("[]"), strict=False):
                    return True
            except ValueError:
                pass
            continue
        name = entry.rsplit(":", 1)[0] if entry.count(":") == 1 else entry
        if name.startswith("."):
            if host.endswith(name):
                return True
        elif host == name or host.endswith(f".{name}"):
            return True
    return False


def from_files(paths: list[Path]) -> Client:
    """The current context of the kubeconfig files merged as kubectl merges them: the first file to name a
    cluster, context or user (or to set current-context) wins. Relative paths resolve against their own file."""
    current = ""
    named: dict[str, dict[str, tuple[dict[str, Any], Path]]] = {"clusters": {}, "contexts": {}, "users": {}}
    for path in paths:
        config = yaml.safe_load(path.read_text())
        if config is None:  # an empty file sets nothing
            continue
        if not isinstance(config, dict):
            raise KubeconfigError(f"{path} is not a YAML mapping")
        current = current or str(config.get("current-context") or "")
        for section, entries in named.items():
            for entry in config.get(section) or ():
                if isinstance(entry, dict) and "name" in entry:
                    entries.setdefault(str(entry["name"]), (entry, path.parent))
    if not current:
        raise KubeconfigError("it has no current-context")
    context, _ = _named(named, "contexts", "context", current)
    cluster, cluster_base = _named(named, "clusters", "cluster", str(context.get("cluster") or ""))
    user, user_base = _named(named, "users", "user", str(context["user"])) if context.get("user") else ({}, Path())
    return _client(cluster, cluster_base, user, user_base)


def _named(
    named: Mapping[str, Mapping[str, tuple[dict[str, Any], Path]]], section: str, key: str, name: str
) -> tuple[dict[str, Any], Path]:
    if name not in named[section]:
        raise KubeconfigError(f"no {key} named {name!r} in {section}")
    entry, base = named[section][name]
    body = entry.get(key)
    if not isinstance(body, dict):
        raise KubeconfigError(f"{key} {name!r} has no {key} mapping")
    return body, base


def _client(cluster: Mapping[str, Any], cluster_base: Path, user: Mapping[str, Any], user_base: Path) -> Client:
    url = str(cluster.get("server") or "").rstrip("/")
    if not url.startswith(("https://", "http://")):
        raise KubeconfigError(f"the cluster's server {url!r} is not an http(s) URL")
    if "auth-provider" in user:
        raise KubeconfigError("its user has an auth-provider, which is not supported: use an exec plugin")
    for setting in ("as", "as-uid", "as-groups", "as-user-extra"):
        if user.get(setting):
            raise KubeconfigError(f"its user sets {setting!r} (impersonation), which is not supported")
    if cluster.get("disable-compression"):
        raise KubeconfigError("its cluster sets disable-compression, which is not supported")
    if isinstance(user.get("exec"), dict) and user["exec"].get("provideClusterInfo"):
        raise KubeconfigError("its user's exec plugin asks for provideClusterInfo, which is not supported")
    cert, key, auth = _credentials(user, user_base)
    context = None
    if url.startswith("https://"):
        ca = _pem(cluster, "certificate-authority", cluster_base)
        context = ssl.create_default_context(cadata=ca.decode() if ca else None)  # none: the system's trust
        if cluster.get("insecure-skip-tls-verify"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cert and key:
            _load_client_certificate(context, cert, key)
    elif cert or key:
        raise KubeconfigError(f"a client certificate is given but the server {url} is not https")
    proxy = cluster.get("proxy-url") or proxy_from_environment(url)
    server = Server(url, context, cluster.get("tls-server-name") or None, proxy)
    return Client(server, auth)


def _credentials(user: Mapping[str, Any], base: Path) -> tuple[bytes | None, bytes | None, Auth]:
    """(client certificate PEM, its key PEM, header auth) of a kubeconfig user."""
    cert = _pem(user, "client-certificate", base)
    key = _pem(user, "client-key", base)
    if bool(cert) != bool(key):
        raise KubeconfigError("its user has a client certificate without a key, or a key without a certificate")
    if user.get("token"):
        return cert, key, StaticHeaders({"Authorization": f"Bearer {user['token']}"})
    if user.get("tokenFile"):
        token_file = _path(user["tokenFile"], base)
        return cert, key, BearerToken(lambda: (_read_token(token_file), None))
    if user.get("username") or user.get("password"):
        basic = base64.b64encode(f"{user.get('username', '')}:{user.get('password', '')}".encode()).decode()
        return cert, key, StaticHeaders({"Authorization": f"Basic {basic}"})
    if user.get("exec"):
        plugin = _ExecPlugin(user["exec"], base)
        status = plugin.start().get("status") or {}
        if status.get("token"):
            return cert, key, BearerToken(plugin.token)
        if status.get("clientCertificateData") and status.get("clientKeyData"):
            return str(status["clientCertificateData"]).encode(), str(status["clientKeyData"]).encode(), StaticHeaders()
        raise KubeconfigError(f"exec plugin {plugin.command!r} returned neither a token nor a client certificate")
    return cert, key, StaticHeaders()


class _ExecPlugin:
    """A credential plugin: runs `command` and reads an ExecCredential from its standard output."""

    def __init__(self, spec: Mapping[str, Any], base: Path) -> None:
        self.command = str(spec.get("command") or "")
        if not self.command:
            raise KubeconfigError("its user's exec has no command")
        # A relative command with a slash is relative to the kubeconfig, as kubectl resolves it.
        if "/" in self.command and not os.path.isabs(self.command):
            self.command = str(base / self.command)
        self._args = [str(a) for a in spec.get("args") or ()]
        self._env = {str(e["name"]): str(e["value"]) for e in spec.get("env") or () if isinstance(e, dict)}
        self._api_version = str(spec.get("apiVersion") or "client.authentication.k8s.io/v1")
        self._first: dict[str, Any] | None = None  # the start-up run's credential, for the first request

    def start(self) -> dict[str, Any]:
        """Run once at start (a plugin that cannot run is a setting error then, not a failed request later)."""
        self._first = self.run()
        return self._first

    def run(self) -> dict[str, Any]:
        info = {"apiVersion": self._api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        env = os.environ | self._env | {"KUBERNETES_EXEC_INFO": json.dumps(info)}
        try:
            done = subprocess.run(
                [self.command, *self._args],
                env=env,
                capture_output=True,
                text=True,
                timeout=EXEC_TIMEOUT_S,
                stdin=subprocess.DEVNULL,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KubeconfigError(f"exec plugin {self.command!r} could not run: {exc}") from None
        if done.returncode != 0:
            raise KubeconfigError(f"exec plugin {self.command!r} exited {done.returncode}: {done.stderr.strip()[:500]}")
        try:
            credential = json.loads(done.stdout)
        except ValueError:
            raise KubeconfigError(f"exec plugin {self.command!r} did not print an ExecCredential") from None
        if not isinstance(credential, dict) or credential.get("kind") != "ExecCredential":
            raise KubeconfigError(f"exec plugin {self.command!r} did not print an ExecCredential")
        return credential

    def token(self) -> tuple[str, float | None]:
        """The token of the credential read at start (once), then of a fresh run each time it is asked for."""
        credential, self._first = self._first or self.run(), None
        status = credential.get("status") or {}
        expiry = status.get("expirationTimestamp")
        expires = parse_rfc3339(expiry) if expiry else None
        if expiry and expires is None:
            raise KubeconfigError(
                f"exec plugin {self.command!r} gave an expirationTimestamp that is not RFC 3339: {str(expiry)[:64]!r}"
            )
        return str(status.get("token") or ""), expires


def _path(value: object, base: Path) -> Path:
    path = Path(str(value))
    return path if path.is_absolute() else base / path


def _pem(section: Mapping[str, Any], key: str, base: Path) -> bytes | None:
    """PEM given inline (`<key>-data`, base64) or by file (`<key>`, relative to `base`); None when neither."""
    if section.get(f"{key}-data"):
        try:
            return base64.b64decode(str(section[f"{key}-data"]), validate=True)
        except ValueError:
            raise KubeconfigError(f"{key}-data is not base64") from None
    if section.get(key):
        return _path(section[key], base).read_bytes()
    return None


def _load_client_certificate(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    """ssl loads a certificate chain only from files: write both to a private directory, load, delete."""
    with tempfile.TemporaryDirectory(prefix="gpu-dra-agent-tls-") as where:
        cert_file, key_file = Path(where) / "client.crt", Path(where) / "client.key"
        for path, data in ((cert_file, cert), (key_file, key)):
            path.touch(mode=0o600)
            path.write_bytes(data)
        context.load_cert_chain(str(cert_file), str(key_file))


def _read_token(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise KubeconfigError(f"cannot read the token file {path}: {exc}") from None
