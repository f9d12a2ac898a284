"""Time from `nvidia.com/mig.config=all-1g.10gb` on the Node to `nvidia.com/mig.config.state=success`, on the
8 GPUs of fake:dgx-h100: the real daemon as a subprocess with the API fake on loopback, alternating with
all-disabled so every round re-partitions all 8 GPUs (56 GPU + 56 compute instances created, or destroyed).

Opt-in: `make bench`. Prints the numbers; the label change is an API write, the end is the state label as a
client watching the Node would see it.
"""

from __future__ import annotations

import os
import statistics
import time

import pytest
from kubernetes import client

import fakes.apiserver
from tests.integration.test_node_support import NODE, Daemon, create_node, running, short_tmpdir

ROUNDS = int(os.environ.get("MIG_BENCH_ROUNDS", "5"))
STATE = "nvidia.com/mig.config.state"


def relabel(server: fakes.apiserver.ApiServer, value: str, timeout: float = 60.0) -> float:
    """Seconds from the label write to the end state, as seen through the API."""
    store = server.store
    ends_before = len([e for e in store.objects("Event") if e["reason"] == "MigConfigApplied"])
    api = client.CoreV1Api(server.api_client())
    t0 = time.perf_counter()
    api.patch_node(NODE, {"metadata": {"labels": {"nvidia.com/mig.config": value}}})
    deadline = t0 + timeout
    while time.perf_counter() < deadline:
        labels = (store.get("Node", NODE) or {})["metadata"].get("labels") or {}
        applied = len([e for e in store.objects("Event") if e["reason"] == "MigConfigApplied"])
        if labels.get(STATE) == "success" and applied > ends_before:
            return time.perf_counter() - t0
        time.sleep(0.002)
    raise AssertionError(f"{value} did not reach success in {timeout}s")


@pytest.mark.bench
@pytest.mark.parametrize("gpu_state", [False, True], ids=["fake-in-memory", "fake-state-file"])
def test_bench_label_to_success_all_1g10gb_on_8_gpus(gpu_state: bool) -> None:
    """In memory, the fake costs little and the numbers are the agent's; with FAKE_NVML_STATE every NVML
    change also rewrites the state file (a rename per call), which the second run shows."""
    with short_tmpdir("migbench-") as root, fakes.apiserver.start(port=0) as server:
        create_node(server.api_client())
        env = {"FAKE_NVML_STATE": str(root / "gpus.json")} if gpu_state else {}
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"), env=env)
        with running(daemon):
            to_mig, to_off = [], []
            for _ in range(ROUNDS):
                to_mig.append(relabel(server, "all-1g.10gb"))
                devices = [d for s in server.store.objects("ResourceSlice") for d in s["spec"].get("devices", [])]
                assert len(devices) == 56
                to_off.append(relabel(server, "all-disabled"))
    print(
        f"\nlabel -> success, fake:dgx-h100 (8 GPUs, {'state file' if gpu_state else 'in memory'}), {ROUNDS} rounds:"
        f"\n  all-1g.10gb (56 MIG devices created): median {statistics.median(to_mig) * 1000:.0f} ms, "
        f"min {min(to_mig) * 1000:.0f} ms, max {max(to_mig) * 1000:.0f} ms"
        f"\n  all-disabled (56 destroyed, MIG off):  median {statistics.median(to_off) * 1000:.0f} ms, "
        f"min {min(to_off) * 1000:.0f} ms, max {max(to_off) * 1000:.0f} ms"
    )
