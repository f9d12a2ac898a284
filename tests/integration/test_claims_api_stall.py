"""A stalled API server (the fake's injected latency) never stalls the node: claims are read before the node
lock is taken, each read ends by the gRPC call's deadline (no silent client retries), and an unprepare, which
needs no API call, is served at once."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.claims import cdi
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import PrepareResult
from agent.kube import errors
from agent.kube.claims import KubeClaimSource
from agent.kubelet import KubeletPlugin
from fakes.kubelet import FakeKubelet, Retry
from tests.integration.test_claims_apiserver import create_allocated
from tests.unit.test_claims_support import DRIVER, NODE, inventory

apiserver = pytest.importorskip("fakes.apiserver")

STALL = 35.0  # longer than the kubelet's wait for any one call


@pytest.fixture
def server() -> Iterator[Any]:
    with apiserver.start(port=0) as server:
        yield server
        server.faults.clear()


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="stall-", dir="/tmp"))  # short: unix socket paths are limited
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_one_read_ends_by_its_deadline_without_retries(server: Any) -> None:
    ref = create_allocated(server.api_client(), "claim-a", ["gpu-0"])
    source = KubeClaimSource(server.rest())
    server.faults.latency(STALL)
    start = time.monotonic()
    with pytest.raises(errors.ApiError, match="cannot reach the API server"):
        source.get(ref.namespace, ref.name, timeout=2.0)
    assert time.monotonic() - start < 6.0  # one attempt of 2 s, not four (urllib3's default retries)


def test_an_unprepare_is_served_during_an_api_stall(server: Any, root: Path) -> None:
    api = server.api_client()
    a = create_allocated(api, "claim-a", ["gpu-0"])
    b = create_allocated(api, "claim-b", ["gpu-1"])
    preparer = ClaimPreparer(
        PrepareSettings(node_name=NODE, driver_name=DRIVER, inventory=inventory, mig_caps=cdi.MigCaps(lambda: None)),
        state_dir=root / "state",
        cdi_root=root / "cdi",
        source=KubeClaimSource(server.rest()),
        boot_id=lambda: "boot-1",
    )
    deadline = 10.0  # the kubelet's wait for one call (45 s on a node; shorter here to keep the test short)
    with KubeletPlugin(DRIVER, root, preparer), FakeKubelet(root, timeout=deadline, retry=Retry(attempts=1)) as kubelet:
        kubelet.scan()
        assert kubelet.prepare(DRIVER, [a])[a.uid].error == ""

        server.faults.latency(STALL)
        stalled: dict[str, PrepareResult] = {}
        took: list[float] = []

        def prepare_b() -> None:
            start = time.monotonic()
            stalled.update(kubelet.prepare(DRIVER, [b]))
            took.append(time.monotonic() - start)

        reading = threading.Thread(target=prepare_b)
        reading.start()
        time.sleep(0.5)  # the prepare of b is now waiting on the API server
        start = time.monotonic()
        assert kubelet.unprepare(DRIVER, [a]) == {a.uid: ""}
        assert reading.is_alive(), "the unprepare waited for the prepare"
        assert time.monotonic() - start < 5.0, "the unprepare waited on the API server"
        reading.join(timeout=deadline + 5)

        assert took and took[0] < deadline, "the prepare outlived the call's deadline"
        assert "no answer from the API server within the call's deadline" in stalled[b.uid].error
        server.faults.clear()
        assert kubelet.prepare(DRIVER, [b])[b.uid].error == ""  # the kubelet's retry, once the API is back
