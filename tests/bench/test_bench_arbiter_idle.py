"""What an idle arbiter costs (opt-in: `make bench`). A cluster where nothing changes: 4 nodes of 8 GPUs full, gangs
waiting behind them. The arbiter as it ships cycles only when something changes or falls due (core.due); beside it,
the same arbiter with `resync_s` 0, which cycles at every look, as every arbiter did before issue 37: one cycle a
period whatever changed. CPU of the cycle's own thread over the same idle time. The cluster is small; on a large
one each cycle spared costs about what the scale bench's cycles do (0.5-0.7 s of CPU at 4,000 nodes)."""

from __future__ import annotations

import time

import pytest

from agent.arbiter.controller import Arbiter, ArbiterConfig
from fakes.cluster import FakeCluster, wait_for

IDLE_S = 15.0


def _idle(cluster: FakeCluster, config: ArbiterConfig) -> tuple[int, float]:
    """Cycles run and the cycle thread's CPU seconds over IDLE_S, once the arbiter has settled."""
    arbiter = cluster.arbiter(config)
    wait_for(lambda: arbiter.cycles >= 2, timeout=60, what="the first cycles")
    time.sleep(3.0)  # its own writes seen (Queue status, Events): settled
    cycles, cpu = arbiter.cycles, _cpu(arbiter)
    time.sleep(IDLE_S)
    out = arbiter.cycles - cycles, _cpu(arbiter) - cpu
    cluster.stop_arbiters()
    return out


def _cpu(arbiter: Arbiter) -> float:
    return sum(arbiter.cpu_timings.values())


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_an_idle_arbiter() -> None:
    with FakeCluster(nodes=4) as cluster:
        cluster.queue("root")
        cluster.queue("team-a", parent="root", gpu_quota=16)
        cluster.queue("team-b", parent="root", gpu_quota=16)
        for i in range(32):
            cluster.pod("team-a", f"run-{i}", "team-a", 1)
        start = cluster.arbiter(ArbiterConfig(period_s=0.2, cycle_gap_s=0.2))
        wait_for(lambda: start.cycles > 0 and len(_admitted(cluster)) == 32, timeout=120, what="32 pods admitted")
        cluster.stop_arbiters()
        for i in range(40):
            cluster.gang("team-b", f"wait-{i}", "team-b", pods=2, gpus=2)  # no room: they wait
        every_look = _idle(cluster, ArbiterConfig(resync_s=0.0))
        as_it_ships = _idle(cluster, ArbiterConfig())
    print(f"\nan idle arbiter, 4 nodes x 8 GPUs full, 32 running pods, 40 gangs waiting, {IDLE_S:.0f} s, period 1 s:")
    for label, (cycles, cpu) in (("a cycle every look (before)", every_look), ("as it ships", as_it_ships)):
        print(f"  {label:<28} {cycles:3d} cycles, cycle thread {cpu * 1000:7.1f} ms CPU ({cpu / IDLE_S * 100:.2f} %)")
    assert as_it_ships[0] == 0 and every_look[0] >= IDLE_S / 2


def _admitted(cluster: FakeCluster) -> list[str]:
    return [p["metadata"]["name"] for p in cluster.pods("team-a") if not (p["spec"].get("schedulingGates") or ())]
