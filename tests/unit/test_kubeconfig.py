"""The agent's own kubeconfig loader and HTTPS client against a TLS server of the test's own: what a user's
kubeconfig may say (inline or file certificates, tokens, exec plugins), and a clear error for what it may not."""

from __future__ import annotations

import base64
import json
import os
import ssl
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from urllib3.exceptions import InsecureRequestWarning

from agent.kube import errors
from agent.kube.kubeconfig import KubeconfigError, connect, in_cluster
from agent.kube.rest import Rest
from tests.controlplane.pki import Pki, make_pki


@dataclass
class Seen:
    """What the server saw of each request, and the tokens it refuses."""

    authorizations: list[str] = field(default_factory=list)
    client_names: list[str] = field(default_factory=list)
    user_agents: list[str] = field(default_factory=list)
    refused: set[str] = field(default_factory=set)


@dataclass
class TlsServer:
    url: str
    pki: Pki
    seen: Seen


@pytest.fixture
def server(tmp_path: Path) -> Iterator[TlsServer]:
    pki = make_pki(tmp_path / "pki")
    seen = Seen()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            authorization = self.headers.get("Authorization", "")
            seen.authorizations.append(authorization)
            seen.user_agents.append(self.headers.get("User-Agent", ""))
            peer = self.connection.getpeercert()  # type: ignore[attr-defined]
            subject = dict(pair[0] for pair in peer["subject"]) if peer else {}
            seen.client_names.append(str(subject.get("commonName", "")))
            refused = authorization.removeprefix("Bearer ") in seen.refused
            body = json.dumps({"kind": "Status", "message": "Unauthorized"} if refused else {"gitVersion": "v1.37.2"})
            self.send_response(401 if refused else 200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: Any) -> None:
            pass

    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.serving_cert), str(pki.serving_key))
    context.verify_mode = ssl.CERT_OPTIONAL  # a client certificate when sent, a token otherwise
    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    http.socket = context.wrap_socket(http.socket, server_side=True)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield TlsServer(f"https://127.0.0.1:{http.server_address[1]}", pki, seen)
    finally:
        http.shutdown()
        http.server_close()


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any] | None = None) -> str:
    config: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "here",
        "clusters": [{"name": "c", "cluster": cluster}],
        "contexts": [{"name": "here", "context": {"cluster": "c", **({"user": "u"} if user is not None else {})}}],
        "users": [{"name": "u", "user": user}] if user is not None else [],
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_inline_ca_and_client_certificate(server: TlsServer, tmp_path: Path) -> None:
    """The shape kubeadm and our control-plane tier write: everything base64 inside the file."""
    rest = connect(
        kubeconfig(
            tmp_path,
            {"server": server.url, "certificate-authority-data": _b64(server.pki.ca_cert)},
            {"client-certificate-data": _b64(server.pki.admin_cert), "client-key-data": _b64(server.pki.admin_key)},
        )
    )
    assert rest.server_version() == "v1.37.2"
    assert server.seen.client_names == ["admin"]
    assert server.seen.authorizations == [""]
    assert server.seen.user_agents[0].startswith("gpu-dra-agent/")  # the audit log says who wrote


def test_files_relative_to_the_kubeconfig_and_a_token_file_read_again(server: TlsServer, tmp_path: Path) -> None:
    (tmp_path / "token").write_text("first\n")
    rest = connect(
        kubeconfig(tmp_path, {"server": server.url, "certificate-authority": "pki/ca.crt"}, {"tokenFile": "token"})
    )
    assert rest.server_version() == "v1.37.2"
    (tmp_path / "token").write_text("second\n")  # rotated in place, as the kubelet does a projected token
    server.seen.refused.add("first")  # the server no longer takes the old one: the 401 makes us read again
    with pytest.raises(errors.ApiError) as refused:
        rest.server_version()
    assert refused.value.status == 401
    assert rest.server_version() == "v1.37.2"
    assert server.seen.authorizations == ["Bearer first", "Bearer first", "Bearer second"]


def counting_plugin(tmp_path: Path, status: str) -> tuple[Path, Path]:
    """An exec plugin (a Python script) that counts its runs in a file and prints an ExecCredential of the
    apiVersion it is asked for, whose status is the Python expression `status` (`n`: this run's number)."""
    counter, plugin = tmp_path / "runs", tmp_path / "plugin.py"
    plugin.write_text(
        "import json, os, pathlib\n"
        f"runs = pathlib.Path({str(counter)!r})\n"
        "n = int(runs.read_text()) + 1 if runs.exists() else 1\n"
        "runs.write_text(str(n))\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "assert info['kind'] == 'ExecCredential' and os.environ['PLUGIN_SETTING'] == 'yes'\n"
        f"print(json.dumps({{'apiVersion': info['apiVersion'], 'kind': 'ExecCredential', 'status': {status}}}))\n"
    )
    return plugin, counter


def exec_kubeconfig(tmp_path: Path, server: TlsServer, plugin: Path, api_version: str) -> str:
    return kubeconfig(
        tmp_path,
        {"server": server.url, "certificate-authority-data": _b64(server.pki.ca_cert)},
        {
            "exec": {
                "apiVersion": api_version,
                "command": sys.executable,
                "args": [str(plugin)],
                "env": [{"name": "PLUGIN_SETTING", "value": "yes"}],
            }
        },
    )


def test_an_exec_plugin_token_is_fetched_again_when_refused(server: TlsServer, tmp_path: Path) -> None:
    """Tried: an exec plugin (EKS, GKE and OIDC logins are ones) whose token the server stops taking."""
    expiring = "{'token': f'token-{n}', 'expirationTimestamp': '2999-01-01T00:00:00Z'}"
    plugin, counter = counting_plugin(tmp_path, expiring)
    rest = connect(exec_kubeconfig(tmp_path, server, plugin, "client.authentication.k8s.io/v1"))
    assert rest.server_version() == "v1.37.2"
    server.seen.refused.add("token-1")
    with pytest.raises(errors.ApiError):
        rest.server_version()
    assert rest.server_version() == "v1.37.2"
    # run 1 at connect gave the first requests' token; run 2 came after the 401
    assert server.seen.authorizations == ["Bearer token-1", "Bearer token-1", "Bearer token-2"]
    assert counter.read_text() == "2"


def test_a_server_that_refuses_every_token_does_not_run_the_plugin_per_request(
    server: TlsServer, tmp_path: Path
) -> None:
    """Tried: credentials revoked for good. A 401 gets one fresh token; while that one is refused too the
    plugin is not run again (for REFUSED_AGAIN_S), however many requests fail."""
    plugin, counter = counting_plugin(tmp_path, "{'token': f'token-{n}'}")
    server.seen.refused.update(f"token-{n}" for n in range(1, 10))
    rest = connect(exec_kubeconfig(tmp_path, server, plugin, "client.authentication.k8s.io/v1beta1"))
    for _ in range(5):
        with pytest.raises(errors.ApiError) as refused:
            rest.server_version()
        assert refused.value.status == 401
    assert counter.read_text() == "2"
    assert server.seen.authorizations == ["Bearer token-1"] + ["Bearer token-2"] * 4


def test_several_kubeconfig_files_merge_as_kubectl_merges_them(server: TlsServer, tmp_path: Path) -> None:
    """KUBECONFIG=a:b: the first file to set current-context or to name an entry wins, a listed file that does
    not exist is skipped, and relative paths resolve against their own file."""
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (second / "ca.crt").write_bytes(server.pki.ca_cert.read_bytes())
    (first / "config").write_text(
        yaml.safe_dump(
            {
                "current-context": "work",
                "contexts": [{"name": "work", "context": {"cluster": "c", "user": "u"}}],
                "users": [{"name": "u", "user": {"token": "from-first"}}],
            }
        )
    )
    (second / "config").write_text(
        yaml.safe_dump(
            {
                "current-context": "elsewhere",
                "clusters": [{"name": "c", "cluster": {"server": server.url, "certificate-authority": "ca.crt"}}],
                "users": [{"name": "u", "user": {"token": "from-second"}}],
            }
        )
    )
    listed = os.pathsep.join([str(first / "config"), str(tmp_path / "missing"), str(second / "config")])
    assert connect(listed).server_version() == "v1.37.2"
    assert server.seen.authorizations == ["Bearer from-first"]


def test_a_server_certificate_signed_by_another_ca_is_refused(server: TlsServer, tmp_path: Path) -> None:
    other = make_pki(tmp_path / "other")
    rest = connect(
        kubeconfig(tmp_path, {"server": server.url, "certificate-authority-data": _b64(other.ca_cert)}, {"token": "t"})
    )
    with pytest.raises(errors.ApiError) as refused:
        rest.server_version()
    assert refused.value.status == 0 and "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
    insecure = connect(kubeconfig(tmp_path, {"server": server.url, "insecure-skip-tls-verify": True}, {"token": "t"}))
    with pytest.warns(InsecureRequestWarning):  # the operator chose it; the process still says so
        assert insecure.server_version() == "v1.37.2"


def test_in_cluster_reads_the_service_account(server: TlsServer, tmp_path: Path) -> None:
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text("pod-token")
    (account / "ca.crt").write_bytes(server.pki.ca_cert.read_bytes())
    port = server.url.rsplit(":", 1)[1]
    rest = Rest(in_cluster(account, {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": port}))
    assert rest.server_version() == "v1.37.2"
    assert server.seen.authorizations == ["Bearer pod-token"]
    with pytest.raises(KubeconfigError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster(account, {})


@pytest.mark.parametrize(
    ("cluster", "user", "says"),
    [
        (
            {"server": "https://127.0.0.1:1"},
            {"auth-provider": {"name": "oidc"}},
            "auth-provider, which is not supported",
        ),
        ({"server": "127.0.0.1:6443"}, {}, "is not an http(s) URL"),
        ({"server": "https://127.0.0.1:1"}, {"client-certificate-data": "Zm9v"}, "without a key"),
        ({"server": "https://127.0.0.1:1", "certificate-authority-data": "not base64!"}, {}, "is not base64"),
        ({"server": "https://127.0.0.1:1"}, {"exec": {"command": "/nonexistent/plugin"}}, "could not run"),
    ],
)
def test_an_unusable_kubeconfig_says_why(
    tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any], says: str
) -> None:
    path = kubeconfig(tmp_path, cluster, user)
    with pytest.raises(KubeconfigError) as unusable:
        connect(path)
    assert str(unusable.value).startswith(f"kubeconfig {path} is not usable: ")
    assert says in str(unusable.value)


def test_a_kubeconfig_without_the_named_context_says_which(tmp_path: Path) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({"current-context": "gone", "contexts": [], "clusters": [], "users": []}))
    with pytest.raises(KubeconfigError, match="no context named 'gone' in contexts"):
        connect(str(path))
    path.write_text("[]")
    with pytest.raises(KubeconfigError, match="not a YAML mapping"):
        connect(str(path))
