"""Prepare + unprepare latency of the claim state machine alone (no gRPC, no API): checkpoint fsyncs, CDI
spec write, lock. Prints p50/p99 for a 1-GPU claim and an 8-claim batch."""

from __future__ import annotations

import pathlib
import shutil
import statistics
import tempfile
import time

import pytest

from agent.claims import cdi
from agent.claims.preparer import ClaimPreparer
from agent.claims.source import StaticClaimSource
from agent.claims.types import ClaimRef
from agent.devices.model import Inventory
from tests.unit.test_claims_support import DRIVER, NODE, claim, gpu

CYCLES = 1000
# On a node the CDI root (/var/run/cdi) is tmpfs and the state dir is on disk; mirror that where we can.
TMPFS = pathlib.Path("/dev/shm")


def _percentiles(samples: list[float]) -> str:
    q = statistics.quantiles(samples, n=100)
    return f"p50 {q[49] * 1e3:.2f} ms  p99 {q[98] * 1e3:.2f} ms  (n={len(samples)})"


@pytest.mark.bench
def test_prepare_unprepare_latency(tmp_path: pathlib.Path) -> None:
    """Side by side, cycles interleaved: specs with no driver files (the agent before issue 19, which left
    them to NVIDIA's runtime hook) and specs carrying a fake driver root's files and hooks (what it writes now)."""
    from agent.driver.startup import set_up
    from fakes.nvml.binaries import install_driver_root

    inv = Inventory("550.54.15", "12.4", gpus=tuple(gpu(i) for i in range(8)))
    source = StaticClaimSource()
    refs = []
    for i in range(8):
        body = claim(f"uid-{i}", [f"gpu-{i}"])
        source.put(body)
        refs.append(ClaimRef("default", f"uid-{i}", body["metadata"]["name"]))
    install_driver_root(tmp_path / "driver-root")
    hook = tmp_path / "driver-root/usr/bin/nvidia-cdi-hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    driver = set_up(tmp_path / "driver-root", "/", inv.driver_version, None)
    assert len(driver.edits["mounts"]) == 17 and driver.hook is not None
    roots = []
    preparers = {}
    for label, edits in (("no driver files", None), ("driver files+hooks", driver.edits)):
        cdi_root = pathlib.Path(tempfile.mkdtemp(dir=TMPFS)) if TMPFS.is_dir() else tmp_path / f"cdi-{len(roots)}"
        roots.append(cdi_root)
        preparers[label] = ClaimPreparer(
            node_name=NODE,
            driver_name=DRIVER,
            state_dir=tmp_path / f"state-{len(roots)}",
            cdi_root=cdi_root,
            source=source,
            inventory=lambda: inv,
            boot_id=lambda: "boot-1",
            mig_caps=cdi.MigCaps(lambda: None),
            driver_edits=edits,
        )
    print(f"\nstate dir {tmp_path} (disk), CDI roots {', '.join(map(str, roots))}")
    for name, batch, cycles in (("1-GPU claim", refs[:1], CYCLES), ("8-claim batch", refs, CYCLES // 5)):
        samples: dict[str, list[float]] = {label: [] for label in preparers}
        for _ in range(cycles):
            for label, preparer in preparers.items():
                start = time.perf_counter()
                results = preparer.prepare(batch)
                errors = preparer.unprepare(batch)
                samples[label].append(time.perf_counter() - start)
                assert not any(r.error for r in results.values()) and not any(errors.values())
        for label, taken in samples.items():
            print(f"claims prepare+unprepare, {name}, {label:19}: {_percentiles(taken)}")
    for cdi_root in roots:
        if cdi_root.parent == TMPFS:
            shutil.rmtree(cdi_root)


@pytest.mark.bench
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("held", [0, 1000])
def test_prepare_latency_does_not_grow_with_claims_held(tmp_path: pathlib.Path, held: int) -> None:
    """Prepare + unprepare of one 1-GPU claim while `held` other claims stay prepared (time-sliced on gpu-7)."""
    from tests.unit.test_claims_support import opaque

    cdi_root = pathlib.Path(tempfile.mkdtemp(dir=TMPFS)) if TMPFS.is_dir() else tmp_path / "cdi"
    inv = Inventory("550.54.15", "12.4", gpus=tuple(gpu(i) for i in range(8)))
    source = StaticClaimSource()
    shared = [opaque(sharing={"strategy": "TimeSlicing"})]
    held_refs = []
    for i in range(held):
        body = claim(f"held-{i:05d}", ["gpu-7"], configs=shared)
        source.put(body)
        held_refs.append(ClaimRef("default", f"held-{i:05d}", body["metadata"]["name"]))
    body = claim("measured", ["gpu-0"])
    source.put(body)
    measured = [ClaimRef("default", "measured", body["metadata"]["name"])]
    preparer = ClaimPreparer(
        node_name=NODE,
        driver_name=DRIVER,
        state_dir=tmp_path / "state",
        cdi_root=cdi_root,
        source=source,
        inventory=lambda: inv,
        boot_id=lambda: "boot-1",
        mig_caps=cdi.MigCaps(lambda: None),
    )
    for start in range(0, held, 50):
        results = preparer.prepare(held_refs[start : start + 50])
        assert not any(r.error for r in results.values())
    prepares, cycles = [], []
    for _ in range(CYCLES // 5):
        start = time.perf_counter()
        results = preparer.prepare(measured)
        prepared = time.perf_counter()
        errors = preparer.unprepare(measured)
        cycles.append(time.perf_counter() - start)
        prepares.append(prepared - start)
        assert not results["measured"].error and not errors["measured"]
    print(f"\nprepare of a 1-GPU claim with {held} claims held: {_percentiles(prepares)}")
    print(f"prepare+unprepare with {held} claims held: {_percentiles(cycles)}")
    if cdi_root.parent == TMPFS:
        shutil.rmtree(cdi_root)
