"""Several arbiter cycles on one snapshot, the world moving on between them: the simulator's rounds.

Pure: the clock is passed in. Each round runs the core's cycle (agent.arbiter.core.cycle) and, when a commit is
given, carries its decisions out (agent.simulation.nodes) before the next round starts from what came of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.arbiter.core.cycle import CycleResult, run_cycle
from agent.arbiter.core.model import Snapshot


@dataclass(frozen=True, slots=True)
class Simulation:
    last: CycleResult
    cycle_seconds: tuple[float, ...]
    # each round's moves (every action but "keep": pod names by action), so what an early round did (an
    # eviction, a pipeline) is not hidden behind the last round's "keep"
    moves: tuple[dict[str, tuple[str, ...]], ...] = ()


def simulate(
    snapshot: Snapshot,
    actions: Sequence[str],
    rounds: int,
    clock: Callable[[], float],
    commit: Callable[[CycleResult], CycleResult] | None = None,
) -> Simulation:
    """`rounds` cycles (at least one), each timed with `clock` (seconds, monotonic). `commit`, when given,
    carries out each cycle's decisions (outside the timed cycle) and returns them as they turned out: the next
    round starts from its result."""
    seconds: list[float] = []
    moves: list[dict[str, tuple[str, ...]]] = []
    result: CycleResult | None = None
    for _ in range(max(1, rounds)):
        if result is not None:
            snapshot = result.next  # between rounds the world moves on
        start = clock()
        result = run_cycle(snapshot, actions)
        seconds.append(clock() - start)
        if commit is not None:
            result = commit(result)
        moves.append(_moves(result))
    assert result is not None
    return Simulation(last=result, cycle_seconds=tuple(seconds), moves=tuple(moves))


def _moves(result: CycleResult) -> dict[str, tuple[str, ...]]:
    by_action: dict[str, list[str]] = {}
    for name, decision in result.pods.items():
        if decision.action != "keep":
            by_action.setdefault(decision.action, []).append(name)
    return {action: tuple(sorted(names)) for action, names in sorted(by_action.items())}
