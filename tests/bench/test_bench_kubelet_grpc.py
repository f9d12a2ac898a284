"""NodePrepareResources + NodeUnprepareResources over the real unix socket, with a trivial in-memory Preparer:
the cost of the gRPC layer alone (the full-stack variant adds the API fake, checkpoint and CDI)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pytest

from agent.claims.types import ClaimRef
from agent.kubelet import KubeletPlugin
from fakes.kubelet import FakeKubelet, InMemoryPreparer

CYCLES = 1000
DRIVER = "gpu.nvidia.com"


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@pytest.mark.bench
@pytest.mark.parametrize("batch", [1, 8])
def test_bench_prepare_unprepare_cycle(batch):
    root = Path(tempfile.mkdtemp(prefix="klb-", dir="/tmp"))
    claims = [ClaimRef("bench", f"uid-{i}", f"claim-{i}") for i in range(batch)]
    try:
        with KubeletPlugin(DRIVER, root, InMemoryPreparer()), FakeKubelet(root) as kubelet:
            kubelet.scan()
            for _ in range(50):  # warm up the channel and the thread pool
                kubelet.prepare(DRIVER, claims)
                kubelet.unprepare(DRIVER, claims)
            samples = []
            for _ in range(CYCLES):
                start = time.perf_counter()
                prepared = kubelet.prepare(DRIVER, claims)
                unprepared = kubelet.unprepare(DRIVER, claims)
                samples.append((time.perf_counter() - start) * 1000)
                assert len(prepared) == batch and not any(r.error for r in prepared.values())
                assert set(unprepared.values()) == {""}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    print(
        f"\nkubelet gRPC prepare+unprepare, {batch}-claim batch, {CYCLES} cycles: "
        f"p50 {p50:.3f} ms, p99 {p99:.3f} ms, mean {statistics.fmean(samples):.3f} ms"
    )
    assert p50 > 0
