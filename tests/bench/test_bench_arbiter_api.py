"""End-to-end admission through the API fake (opt-in: `make bench`): 32 nodes x 8 GPUs whose agents serve
reservations over a fake DGX H100, 1,000 gated pods of one GPU each in gangs of 1 to 8 across 4 queues, the
arbiter and the controller stand-ins in this process. Admitted pods complete (are deleted) at once, so all
1,000 pass through 256 GPUs. Prints pods admitted per second, gate to committed (the gate removed), and where
the arbiter's time went."""

from __future__ import annotations

import random
import threading
import time

import pytest

from agent.arbiter.controller import ArbiterConfig
from agent.arbiter.names import GATE
from agent.kube.rest import PODS
from fakes.cluster import FakeCluster, wait_for

PODS_TOTAL = 1000
QUEUES = 4


@pytest.mark.bench
@pytest.mark.timeout(900)
def test_admission_through_the_api() -> None:
    rng = random.Random(7)
    with FakeCluster(nodes=32, apiserver_process=True) as cluster:
        cluster.queue("root")
        for q in range(QUEUES):
            cluster.queue(f"q{q}", parent="root", gpu_quota=64)
        gangs = []
        left = PODS_TOTAL
        while left:
            size = min(left, rng.randint(1, 8))
            gangs.append((f"q{len(gangs) % QUEUES}", f"g{len(gangs)}", size))
            left -= size
        for q, name, size in gangs:
            cluster.gang(f"ns-{q}", name, q, pods=size, gpus=1)
        wait_for(lambda: all(len((p.get("status") or {}).get("resourceClaimStatuses") or ()) == 1
                             for p in cluster.pods()), timeout=300, what="claims from templates")
        admitted: dict[str, float] = {}
        done = threading.Event()

        def complete() -> None:  # admitted pods finish at once: their GPUs go to the next gangs
            while not done.is_set():
                for p in cluster.controllers.pods.items():
                    meta = p["metadata"]
                    key = f"{meta['namespace']}/{meta['name']}"
                    if key in admitted or meta.get("deletionTimestamp"):
                        continue
                    if not any(g.get("name") == GATE for g in p["spec"].get("schedulingGates") or ()):
                        admitted[key] = time.perf_counter()
                        cluster.rest.delete(PODS, meta["namespace"], meta["name"])
                time.sleep(0.01)

        completer = threading.Thread(target=complete, daemon=True)
        completer.start()
        start = time.perf_counter()
        arbiter = cluster.arbiter(ArbiterConfig(period_s=0.05))
        try:
            wait_for(lambda: len(admitted) >= PODS_TOTAL, timeout=600, interval=0.05, what="all admitted")
        finally:
            done.set()
        wall = max(admitted.values()) - start
        print(f"\n32 nodes x 8 GPUs, {PODS_TOTAL} pods in {len(gangs)} gangs of 1-8 across {QUEUES} queues:")
        print(f"  admitted {len(admitted)} pods in {wall:.2f} s: {len(admitted) / wall:.0f} pods/s gate to committed")
        print(f"  arbiter cycles {arbiter.cycles}; time in: " + ", ".join(
            f"{k} {v:.2f} s" for k, v in sorted(arbiter.timings.items(), key=lambda kv: -kv[1])))
        print("  commit steps (summed over parallel commits): " + ", ".join(
            f"{k} {v:.2f} s" for k, v in arbiter._committer.timings.items()))
        assert len(admitted) == PODS_TOTAL
