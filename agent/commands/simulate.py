"""`gpu-dra-agent simulate SNAPSHOT.json`: run arbiter cycles on a cluster snapshot, print decisions as JSON.

Reading the file and the clock happen here; the decisions are agent.arbiter.core's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from agent.arbiter.core.cycle import (
    DEFAULT_ACTIONS,
    Simulation,
    fair_share_in_units,
    gc_paused,
    simulate,
    unknown_actions,
)
from agent.arbiter.core.snapshot import SnapshotError, parse_snapshot


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("snapshot", metavar="SNAPSHOT.json", help="cluster snapshot: nodes, queues, jobs")
    parser.add_argument(
        "--actions",
        default=",".join(DEFAULT_ACTIONS),
        help="comma-separated actions run once per round, in this order (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="cycles to run (default: 1)")


def run(args: argparse.Namespace) -> int:
    actions = [a.strip() for a in str(args.actions).split(",") if a.strip()]
    unknown = unknown_actions(actions)
    if unknown or not actions:
        return _fail(f"unknown action {unknown[0]!r}; choose from allocate, consolidate, reclaim, preempt."
                     if unknown else "--actions names no action.")
    if args.rounds < 1:
        return _fail(f"--rounds must be at least 1, not {args.rounds}.")
    # one shot: what it builds (a pod object or three per pod) lives until the process ends, so a collector
    # running meanwhile would only rescan it
    with gc_paused():
        return _simulate(args, actions)


def _simulate(args: argparse.Namespace, actions: list[str]) -> int:
    try:
        with open(args.snapshot, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        return _fail(f"cannot read {args.snapshot}: {e.strerror or e}.")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _fail(f"{args.snapshot} is not valid JSON: {e}.")
    try:
        snapshot = parse_snapshot(doc)
        result = simulate(snapshot, actions, args.rounds, time.perf_counter)
    except SnapshotError as e:
        return _fail(f"{args.snapshot}: {e}")
    json.dump(render(result), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


def render(sim: Simulation) -> dict[str, Any]:
    """The output document: per-pod decisions of the last round, fair shares, rounds and cycle times."""
    pods: dict[str, Any] = {}
    for name, d in sim.last.pods.items():
        entry: dict[str, Any] = {"outcome": d.outcome, "node": d.node, "action": d.action}
        if d.gpu_index is not None:
            entry["gpuIndex"] = d.gpu_index
        if d.moved_to is not None:
            entry["movedTo"] = d.moved_to
        if d.cause is not None:
            entry["evictedBy"] = d.cause
        pods[name] = entry
    return {
        "pods": pods,
        "fairShare": {q: fair_share_in_units(v) for q, v in sim.last.fair_share.items()},
        "rounds": len(sim.cycle_seconds),
        "cycleSeconds": [round(s, 6) for s in sim.cycle_seconds],
    }


def _fail(message: str) -> int:
    sys.stderr.write(f"gpu-dra-agent simulate: {message}\n")
    return 2
