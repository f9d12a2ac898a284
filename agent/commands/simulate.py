"""`gpu-dra-agent simulate SNAPSHOT.json`: run arbiter cycles on a cluster snapshot, print decisions as JSON.

Reading the file and the clock happen here; the decisions are agent.arbiter.core's. Unless --no-reservations,
each round's bound gangs are then committed through the reservation protocol to in-process node allocators
(agent.simulation.nodes): a gang a node refuses is reported pending, with the node's reason as "refused".
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from agent.arbiter.core.cycle import ACTIONS, DEFAULT_ACTIONS, fair_share_in_units, gc_paused, unknown_actions
from agent.arbiter.core.snapshot import SnapshotError, parse_snapshot
from agent.commands.options import SettingError
from agent.simulation.nodes import ReservationCommit
from agent.simulation.rounds import Simulation, simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "snapshot",
        metavar="SNAPSHOT.json",
        help="cluster snapshot: nodes, queues, jobs; the format is agent/simulation/snapshot/"
        "snapshot.schema.json, an example agent/simulation/snapshot/example.json",
    )
    parser.add_argument(
        "--actions",
        default=",".join(DEFAULT_ACTIONS),
        help="comma-separated actions run once per round, in this order (default: %(default)s)",
    )
    parser.add_argument("--rounds", type=int, default=1, help="cycles to run (default: 1)")
    parser.add_argument(
        "--no-reservations",
        dest="reservations",
        action="store_false",
        help="take the arbiter's decisions as they are, without reserving devices on the nodes",
    )
    parser.add_argument(
        "--report-reservations",
        action="store_true",
        help='add a "reservations" summary: gangs committed, refused, relocated; releases',
    )


def run(args: argparse.Namespace) -> int:
    actions = [a.strip() for a in str(args.actions).split(",") if a.strip()]
    unknown = unknown_actions(actions)
    if unknown or not actions:
        return _fail(
            f"unknown action {unknown[0]!r}; choose from {', '.join(ACTIONS)}."
            if unknown
            else "--actions names no action."
        )
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
    except RecursionError:
        return _fail(f"{args.snapshot} nests JSON too deeply to be a snapshot.")
    try:
        snapshot = parse_snapshot(doc)  # its sentences name the object; the schema then checks the rest
        _check_schema(doc)
        commit = (
            ReservationCommit(snapshot.nodes, time.monotonic, secrets.token_urlsafe(32)) if args.reservations else None
        )
        result = simulate(snapshot, actions, args.rounds, time.perf_counter, commit)
    except SnapshotError as e:
        return _fail(f"{args.snapshot}: {e}")
    out = render(result, commit)
    if args.report_reservations:
        out["reservations"] = reservations_summary(commit)
    json.dump(out, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


def render(sim: Simulation, commit: ReservationCommit | None = None) -> dict[str, Any]:
    """The output document: per-pod decisions of the last round, each round's moves (the pods of every action
    but "keep"), fair shares, rounds and cycle times."""
    refused = commit.stats.refused_pods if commit is not None else {}
    pods: dict[str, Any] = {}
    for name, d in sim.last.pods.items():
        entry: dict[str, Any] = {"outcome": d.outcome, "node": d.node, "action": d.action}
        if d.gpu_index is not None:
            entry["gpuIndex"] = d.gpu_index
        if d.moved_to is not None:
            entry["movedTo"] = d.moved_to
        if d.cause is not None:
            entry["evictedBy"] = d.cause
        if name in refused:
            entry["refused"] = refused[name]
        pods[name] = entry
    return {
        "pods": pods,
        "fairShare": {q: fair_share_in_units(v) for q, v in sim.last.fair_share.items()},
        "rounds": len(sim.cycle_seconds),
        "moves": [{action: list(names) for action, names in round_moves.items()} for round_moves in sim.moves],
        "cycleSeconds": [round(s, 6) for s in sim.cycle_seconds],
    }


def reservations_summary(commit: ReservationCommit | None) -> dict[str, Any]:
    """Totals over all rounds (zeros when reservations are off)."""
    if commit is None:
        return {"committed": 0, "released": 0, "refused": 0, "relocated": 0, "commitSeconds": []}
    s = commit.stats
    return {
        "committed": s.committed,
        "released": s.released,
        "refused": s.refused,
        "relocated": s.relocated,
        "commitSeconds": [round(t, 6) for t in s.seconds],
    }


SCHEMA = Path(__file__).resolve().parents[1] / "simulation" / "snapshot" / "snapshot.schema.json"
EXAMPLE = SCHEMA.with_name("example.json")


def _check_schema(doc: object) -> None:
    """The snapshot format as documented (agent/simulation/snapshot/snapshot.schema.json)."""
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ModuleNotFoundError:
        _fail(
            "checking a snapshot needs jsonschema, from the 'simulation' extra: pip install 'gpu-dra-agent[simulation]'"
        )

    validator = jsonschema.Draft202012Validator(json.loads(SCHEMA.read_text()))
    error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
    if error is not None:
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path) or "the snapshot"
        raise SnapshotError(f"{where.lstrip('.')}: {error.message} (see {SCHEMA.name}).")


def _fail(message: str) -> NoReturn:
    raise SettingError(message)
