"""One `cluster` fixture for tests that must hold against both API servers: the embedded fake (fresh per test)
and the real control plane 1.37 (one per session, emptied between tests). The real tier builds its binaries
on first use (see tests/conftest.py) and is skipped, with the reason, where Go is absent."""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from kubernetes import client

import fakes.apiserver
from agent.kube.rest import Rest
from tests.conftest import STARTUP_KEY
from tests.controlplane import cluster as real

if TYPE_CHECKING:
    import fakes.cluster

REAL_TIER = "controlplane"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
QUEUE_CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/queues.scheduling.gpu-dra-agent.io"
# the params of a fixture that yields `fake_or_real_world`
FAKE_AND_REAL = ["fake", pytest.param("real", marks=[pytest.mark.controlplane, pytest.mark.timeout(300)])]


def kubectl(config: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """kubectl itself with `config`, its discovery cache beside it (one per test, never another test's); the
    result whatever its exit status. For tests marked needs_kubectl."""
    assert KUBECTL is not None
    return subprocess.run(
        [KUBECTL, f"--kubeconfig={config}", f"--cache-dir={config.parent / 'cache'}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


class Response:
    """What a client sees of one request: the status code and the decoded body (text where not JSON)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.data = body
        try:
            self.body: Any = json.loads(body)
        except ValueError:
            self.body = body.decode(errors="replace")

    def __repr__(self) -> str:
        return f"Response({self.status}, {self.body!r})"


def _send(url: str, method: str, body: Any, headers: dict[str, str], context: ssl.SSLContext | None) -> Response:
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return Response(answer.status, answer.read())
    except urllib.error.HTTPError as error:
        return Response(error.code, error.read())


def _headers(method: str, headers: dict[str, str] | None) -> dict[str, str]:
    content = "application/merge-patch+json" if method == "PATCH" else "application/json"
    return {"Content-Type": content, "Accept": "application/json", **(headers or {})}


class FakeCluster:
    kind = "fake"

    def __init__(self, server: fakes.apiserver.ApiServer) -> None:
        self.server = server

    def api_client(self) -> Any:
        return self.server.api_client()

    def rest(self) -> Rest:
        return self.server.rest()

    def write_kubeconfig(self, path: str | Path) -> Path:
        return self.server.write_kubeconfig(path)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        created = client.CoreV1Api(self.api_client()).create_node(
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}}
        )
        return dict(self.api_client().sanitize_for_serialization(created))

    def raw(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Response:
        """One HTTP request as any client would send it; errors are returned, not raised."""
        return _send(self.server.url + path, method, body, _headers(method, headers), None)


class RealCluster:
    kind = "real"

    def __init__(self, cp: real.ControlPlane) -> None:
        self.cp = cp

    def api_client(self) -> Any:
        return self.cp.api_client()

    def rest(self) -> Rest:
        return self.cp.rest()

    def write_kubeconfig(self, path: str | Path) -> Path:
        return self.cp.write_kubeconfig(path)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        return self.cp.add_node(name, labels)

    def raw(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None) -> Response:
        return _send(self.cp.url + path, method, body, _headers(method, headers), self.cp.ssl_context())


Cluster = FakeCluster | RealCluster


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest, control_plane_binaries: Path) -> Iterator[real.ControlPlane]:
    """The real control plane, started once per session (build or skip decided in tests/conftest.py)."""
    binaries = control_plane_binaries
    started = time.monotonic()
    cp = real.ControlPlane(binaries).start()
    request.config.stash[STARTUP_KEY] = (time.monotonic() - started, dict(cp.startup_seconds))
    try:
        yield cp
    finally:
        cp.stop()


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.controlplane)])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    if request.param == "fake":
        with fakes.apiserver.start(port=0) as server:
            yield FakeCluster(server)
        return
    cp: real.ControlPlane = request.getfixturevalue("control_plane")
    try:
        yield RealCluster(cp)
    finally:
        real.reset(cp)


@contextlib.contextmanager
def world_on_control_plane(
    cp: real.ControlPlane, nodes: int, namespaces: list[str], name: str
) -> Iterator[fakes.cluster.FakeCluster]:
    """A fakes.cluster world of `nodes` GPU nodes on the session's real control plane, emptied before and after:
    the pods left in `namespaces` deleted (no kubelet confirms them), the Queue CRD (every Queue with it) and the
    nodes gone, so the next test starts clean. `name` names its kubeconfig."""
    from fakes.cluster import FakeCluster as World
    from tests.integration.coexistence import force_delete_pods

    real.reset(cp)
    world = World(nodes=nodes, kubeconfig=cp.write_kubeconfig(cp.workdir / f"{name}.kubeconfig"), make_node=cp.add_node)
    try:
        yield world
    finally:
        world.close()
        force_delete_pods(world.rest, namespaces)
        cp.request("DELETE", QUEUE_CRD)
        real.reset(cp, timeout=120)  # the nodes too, their taints and labels with them


def fake_or_real_world(
    request: pytest.FixtureRequest, nodes: int, namespaces: list[str]
) -> Iterator[fakes.cluster.FakeCluster]:
    """The body of a fixture parametrised with FAKE_AND_REAL: a fakes.cluster world on the API fake, or on the real
    control plane (world_on_control_plane)."""
    from fakes.cluster import FakeCluster as World

    if request.param == "fake":
        with World(nodes=nodes) as fake:
            yield fake
        return
    name = request.module.__name__.rsplit(".", 1)[-1]
    with world_on_control_plane(request.getfixturevalue("control_plane"), nodes, namespaces, name) as world:
        yield world
