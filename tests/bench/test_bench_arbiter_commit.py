"""Commit cost benchmark (opt-in: `make bench`): `simulate` on 1,000 nodes x 8 GPUs with and without committing
each round's gangs through the reservation protocol. Wall-clock times: run it twice on a shared machine."""

from __future__ import annotations

import time

import pytest

from agent.arbiter.core.cycle import DEFAULT_ACTIONS
from agent.simulation.nodes import ReservationCommit
from agent.simulation.rounds import simulate
from tests.bench.test_bench_arbiter_scale import synthetic


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_simulate_with_and_without_reservations() -> None:
    snapshot = synthetic(1_000, 4_000, 10_000)
    rounds = 3
    start = time.perf_counter()
    plain = simulate(snapshot, DEFAULT_ACTIONS, rounds, time.perf_counter)
    plain_total = time.perf_counter() - start
    commit = ReservationCommit(snapshot.nodes, time.monotonic, "bench-token")
    start = time.perf_counter()
    committed = simulate(snapshot, DEFAULT_ACTIONS, rounds, time.perf_counter, commit)
    committed_total = time.perf_counter() - start
    s = commit.stats
    print(f"\n1,000 nodes x 8 GPUs, 4,000 running + 10,000 pending pods, {rounds} rounds:")
    print(f"  without reservations: cycles {_fmt(plain.cycle_seconds)} s, total {plain_total:.3f} s")
    print(
        f"  with reservations:    cycles {_fmt(committed.cycle_seconds)} s, commits {_fmt(s.seconds)} s, "
        f"total {committed_total:.3f} s"
    )
    print(
        f"  gangs committed {s.committed}, refused {s.refused}, relocated {s.relocated}, "
        f"reservations released {s.released}"
    )
    assert s.refused == 0  # the arbiter's view is consistent: no node may refuse


def _fmt(values: tuple[float, ...] | list[float]) -> str:
    return ", ".join(f"{v:.3f}" for v in values)
