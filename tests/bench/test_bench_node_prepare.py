"""The node daemon, full stack: `gpu-dra-agent node` as a subprocess on fake:dgx-h100, the API fake on loopback,
the real ClaimPreparer (checkpoint records, CDI files), NodePrepareResources + NodeUnprepareResources from the
kubelet fake over the real unix socket; and the time from start to the first ResourceSlice.

Opt-in: `make bench`. Prints p50/p99 for a 1-GPU claim, a MIG device and an 8-GPU claim; the target (issue 37)
is a prepare p99 under 5 ms for the 1-GPU claim on an idle 2-core VM, state on its ext4 disk. The VM is shared,
so each case also prints how busy the machine was (ours and others' CPU) and the daemon's CPU a prepare: the
driver's own work; the rest of a prepare's time is the fakes' (kubelet, API server) or waiting, for a CPU that
others' work holds among other things.
"""

from __future__ import annotations

import cProfile
import os
import pathlib
import pstats
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kubernetes import client

import fakes.apiserver
from agent.claims.types import ClaimRef
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import open_nvml
from fakes.kubelet import FakeKubelet
from fakes.nvml.binaries import install_driver_root
from tests.bench.machine import Busy, thread_times_ms
from tests.integration.test_node_support import (
    DRIVER,
    MACHINE,
    NODE,
    Daemon,
    allocate_claim,
    create_node,
    running,
    short_tmpdir,
)

CYCLES = int(os.environ.get("NODE_BENCH_CYCLES", "1000"))
WARMUP = 50
PROFILED_CYCLES = 200


# Where the state dir and CDI root live: tmpfs, as deployed (both under /var/run, cleared at boot like the
# claims they describe), or the VM disk (ext4: each checkpoint save's fsyncs are journal commits, ~ms here).
def _tmpfs_outside_dev() -> str:
    """/run or /tmp where it is a tmpfs (as on a node: the state dir is /var/run), or "" where neither is; never
    /dev/shm (the agent refuses a state dir on /dev) nor another system mount."""
    tmpfs = {
        line.split()[1] for line in pathlib.Path("/proc/mounts").read_text().splitlines() if line.split()[2] == "tmpfs"
    }
    return next((where for where in ("/run", "/tmp") if where in tmpfs and os.access(where, os.W_OK)), "")


STORAGE = {"disk": "/tmp", "tmpfs": _tmpfs_outside_dev()}
STARTS = 3


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(samples: list[float]) -> str:
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    return f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, mean {statistics.fmean(samples):.2f} ms"


@pytest.fixture(scope="module")
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        create_node(srv.api_client())
        yield srv


# The three claims measured: (node, its fake machine, the devices of the claim or "mig" for the first MIG device
# the node publishes).
CASES = {
    "1-GPU claim": (NODE, MACHINE, ["gpu-0"]),
    "MIG device": ("node-mig", "fake:mixed-mig", ["mig"]),
    "8-GPU claim": (NODE, MACHINE, [f"gpu-{i}" for i in range(8)]),
}
# Prepare p50/p99 in ms before issue 37 (YAML specs, four fsyncs a prepare): this bench, state on disk, on the
# same 2-core VM back to back with the change, at load ~2 from other work (the idle-est of six runs). The
# issue's own figure, on an idle VM of this kind: prepare+unprepare of a 1-GPU claim p50 7.7 ms, p99 11.9 ms.
BEFORE_PREPARE_MS: dict[str, tuple[float, float]] = {
    "1-GPU claim": (4.90, 12.08),
    "MIG device": (5.45, 14.25),
    "8-GPU claim": (6.34, 13.61),
}
TARGET_PREPARE_P99_MS = 5.0


def first_mig_device(server: fakes.apiserver.ApiServer, node: str) -> str:
    for s in server.store.objects("ResourceSlice"):
        if s["spec"].get("nodeName") == node:
            found = [d["name"] for d in s["spec"].get("devices") or () if "-mig-" in d["name"]]
            if found:
                return str(sorted(found)[0])
    raise AssertionError(f"node {node} publishes no MIG device")


@pytest.mark.bench
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("storage", sorted(STORAGE))
@pytest.mark.parametrize("case", list(CASES))
def test_bench_node_prepare_unprepare(server: fakes.apiserver.ApiServer, case: str, storage: str) -> None:
    if not STORAGE[storage] or not pathlib.Path(STORAGE[storage]).is_dir():
        pytest.skip(f"no {storage} here outside /dev (the agent refuses a state dir on /dev)")
    node, machine, devices = CASES[case]
    api = server.api_client()
    if node != NODE:
        client.CoreV1Api(api).create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
    with short_tmpdir("nbench-", STORAGE[storage]) as root:
        # the specs carry a driver's files and hooks, as on a GPU node (issue 19)
        driver_root = install_driver_root(root / "driver-root").parents[1]
        (driver_root / "usr/bin/nvidia-cdi-hook").write_text("#!/bin/sh\n")
        (driver_root / "usr/bin/nvidia-cdi-hook").chmod(0o755)
        daemon = Daemon(
            root,
            server.write_kubeconfig(root / "kubeconfig"),
            node=node,
            machine=machine,
            extra_args=("--driver-root", str(driver_root)),
        )
        with running(daemon), FakeKubelet(daemon.kubelet_root) as kubelet:
            kubelet.wait_for_driver(DRIVER)
            if devices == ["mig"]:
                devices = [first_mig_device(server, node)]
            refs = [allocate_claim(api, f"bench-{len(devices)}-{storage}-{node}", devices, pool=node)]
            for _ in range(WARMUP):
                cycle(kubelet, refs, len(devices))
            assert daemon.proc is not None
            ours = (os.getpid(), daemon.proc.pid)
            with Busy({"bench and API fake": ours[0], "daemon": ours[1]}) as busy:
                cycles = [cycle(kubelet, refs, len(devices), ours[1]) for _ in range(CYCLES)]
            assert daemon.terminate() == 0
    prepare, unprepare = [c.prepare_ms for c in cycles], [c.unprepare_ms for c in cycles]
    p99 = percentile(prepare, 99)
    before = BEFORE_PREPARE_MS.get(case)
    was = f"  (before: p50 {before[0]:.2f} ms, p99 {before[1]:.2f} ms)" if before else ""
    verdict = ("meets" if p99 < TARGET_PREPARE_P99_MS else "MISSES") + f" the {TARGET_PREPARE_P99_MS:.0f} ms p99 target"
    print(
        f"\nnode daemon, {case} ({', '.join(devices)}), specs with a fake driver root's files and hooks, "
        f"state and CDI on {storage} ({STORAGE[storage]}), {CYCLES} cycles over the unix socket:\n"
        f"  prepare           {summary(prepare)}{was}  ({verdict})\n"
        f"  unprepare         {summary(unprepare)}\n"
        f"  prepare+unprepare {summary([p + u for p, u in zip(prepare, unprepare, strict=True)])}\n"
        f"  daemon CPU a prepare {summary([c.prepare_cpu_ms for c in cycles])}\n"
        f"  {busy.describe()}"
    )


def cycle(kubelet: FakeKubelet, refs: list[ClaimRef], devices: int = 1, daemon: int | None = None) -> Cycle:
    """One prepare and one unprepare; with `daemon` (its pid), the CPU it used during the prepare, all threads
    together (read from this process, outside the timed spans)."""
    ours = () if daemon is None else (daemon,)
    on_cpu = thread_times_ms(ours)[0]
    start = time.perf_counter()
    prepared = kubelet.prepare(DRIVER, refs)
    middle = time.perf_counter()
    used = thread_times_ms(ours)[0] - on_cpu
    resumed = time.perf_counter()
    unprepared = kubelet.unprepare(DRIVER, refs)
    end = time.perf_counter()
    assert all(r.error == "" and len(r.devices) == devices for r in prepared.values()), prepared
    assert set(unprepared.values()) == {""}, unprepared
    return Cycle((middle - start) * 1000, (end - resumed) * 1000, used)


@dataclass(frozen=True)
class Cycle:
    prepare_ms: float
    unprepare_ms: float
    # The daemon's CPU during the prepare: the driver's own work, whatever else runs (the kubelet and API fakes
    # stand in for others'); the rest of the prepare's time is theirs or waiting (for a CPU, a thread, the disk).
    prepare_cpu_ms: float


def wait_for_slice(server: fakes.apiserver.ApiServer, daemon: Daemon, timeout: float = 60.0) -> float:
    """Seconds from process start until a ResourceSlice of the node is in the API."""
    deadline = time.monotonic() + timeout
    while not server.store.objects("ResourceSlice"):
        assert daemon.proc is not None and daemon.proc.poll() is None, daemon.tail()
        assert time.monotonic() < deadline, f"no slice within {timeout}s"
        time.sleep(0.005)
    return time.perf_counter() - daemon.started_at


def delete_slices(server: fakes.apiserver.ApiServer) -> None:
    client.ResourceV1Api(server.api_client()).delete_collection_resource_slice()
    assert not server.store.objects("ResourceSlice")


@pytest.mark.bench
def test_bench_start_to_first_slice(server: fakes.apiserver.ApiServer) -> None:
    subprocess_s = []
    for _ in range(STARTS):
        delete_slices(server)
        with short_tmpdir("nbench-") as root:
            daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig")).start()
            try:
                subprocess_s.append(wait_for_slice(server, daemon))
                daemon.wait_serving()
                assert daemon.terminate() == 0
            finally:
                daemon.close()

    delete_slices(server)
    with short_tmpdir("nbench-") as root, open_nvml(MACHINE) as nvml:
        config = NodeConfig(NODE, DRIVER, root / "kubelet", root / "cdi", root / "state")
        began = time.perf_counter()
        agent = NodeAgent(config, nvml, rest=server.rest())
        constructed = time.perf_counter()
        agent.start()
        started = time.perf_counter()
        try:
            assert server.store.objects("ResourceSlice"), "start() returned before publishing"
        finally:
            agent.shutdown()
    print(
        "\ndgx-h100 start to first ResourceSlice: subprocess (exec, imports, NVML, publish) "
        + ", ".join(f"{s * 1000:.0f}" for s in subprocess_s)
        + f" ms (median {statistics.median(subprocess_s) * 1000:.0f} ms);\n"
        f"  in-process, modules already imported: NodeAgent() {(constructed - began) * 1000:.0f} ms "
        "(discovery, API clients), "
        f"start() {(started - constructed) * 1000:.0f} ms (recover, publish, serve)"
    )


def cumulative_ms(stats: pstats.Stats, file_suffix: str, function: str) -> float:
    """Cumulative milliseconds of every profiled function named `function` in a file ending `file_suffix`."""
    table: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = stats.stats  # type: ignore[attr-defined]
    return 1000.0 * sum(
        ct for (f, _, name), (_, _, _, ct, _) in table.items() if f.endswith(file_suffix) and name == function
    )


@pytest.mark.bench
def test_bench_node_prepare_profile(server: fakes.apiserver.ApiServer) -> None:
    """Where a prepare+unprepare cycle spends its time: the real ClaimPreparer in-process, state on disk."""
    api = server.api_client()
    ref = allocate_claim(api, "bench-profile", ["gpu-0"])
    with short_tmpdir("nbench-") as root, open_nvml(MACHINE) as nvml:
        config = NodeConfig(NODE, DRIVER, root / "kubelet", root / "cdi", root / "state")
        agent = NodeAgent(config, nvml, rest=server.rest())
        for _ in range(WARMUP // 5):
            agent.preparer.prepare([ref])
            agent.preparer.unprepare([ref])
        profile = cProfile.Profile()
        began = time.perf_counter()
        profile.enable()
        for _ in range(PROFILED_CYCLES):
            assert agent.preparer.prepare([ref])[ref.uid].error == ""
            assert agent.preparer.unprepare([ref]) == {ref.uid: ""}
        profile.disable()
        wall_ms = (time.perf_counter() - began) * 1000
    stats = pstats.Stats(profile)
    parts = {
        "agent/claims/checkpoint.py CheckpointStore.save": cumulative_ms(stats, "claims/checkpoint.py", "save"),
        "agent/claims/cdi.py CdiStore.write": cumulative_ms(stats, "claims/cdi.py", "write"),
        "agent/claims/cdi.py CdiStore.remove": cumulative_ms(stats, "claims/cdi.py", "remove"),
        "agent/kube/claims.py KubeClaimSource.get (the API GET)": cumulative_ms(stats, "kube/claims.py", "get"),
        "os.fsync (within the saves, writes and removals)": cumulative_ms(stats, "~", "<built-in method posix.fsync>"),
        "os.replace (within the saves and writes)": cumulative_ms(stats, "~", "<built-in method posix.replace>"),
    }
    assert sum(parts.values()) > 0
    print(
        f"\nprofile of {PROFILED_CYCLES} in-process prepare+unprepare cycles, state and CDI on /tmp: "
        f"{wall_ms / PROFILED_CYCLES:.2f} ms a cycle"
    )
    for what, ms in parts.items():
        print(f"  {what:56} {ms / PROFILED_CYCLES:6.2f} ms a cycle, {100 * ms / wall_ms:5.1f}%")
