"""The coexistence run at full size, repeated (opt-in: `make coexistence`, or COEXISTENCE_RUNS=N with
`make bench`): 600 arbiter gang pods and 600 ordinary DRA pods interleaved on 32 nodes (256 GPUs), 100 of the
ordinary pods created before the arbiter starts, both schedulers live, each run on a fresh real control plane
with kube-controller-manager and kube-scheduler at `--kube-api-qps=500`. Every run must end with no device
ever in two claims (checked on every claim event) and every pod through."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

from fakes.cluster import FakeCluster
from tests.integration import coexistence

RUNS = int(os.environ.get("COEXISTENCE_RUNS", "0"))


@pytest.mark.controlplane
@pytest.mark.bench
@pytest.mark.timeout(4 * 3600)
@pytest.mark.skipif(RUNS < 1, reason="set COEXISTENCE_RUNS (make coexistence: 10)")
def test_no_device_is_in_two_claims_in_every_full_run(control_plane_binaries: Any) -> None:
    from tests.controlplane.cluster import ControlPlane

    results = []
    for i in range(RUNS):
        with ControlPlane(control_plane_binaries, client_qps=500).start() as cp:
            path = cp.write_kubeconfig(cp.workdir / "coexistence.kubeconfig")
            with FakeCluster(nodes=32, kubeconfig=path, make_node=cp.add_node) as cluster:
                started = time.monotonic()
                out = coexistence.run(cluster, gang_pods=600, plain_pods=600, before=100, seed=i, timeout_s=1200)
                print(f"run {i + 1}/{RUNS} ({time.monotonic() - started:.0f} s): {out.summary()}", flush=True)
                results.append(out)
    clean = sum(1 for r in results if not r.collisions and not r.left)
    print(f"{clean}/{RUNS} runs with no device in two claims and every pod through")
    assert clean == RUNS
