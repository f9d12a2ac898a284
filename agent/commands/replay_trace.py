"""`gpu-dra-agent replay-trace`: replay an openb trace under placement policies, side by side.

stdout carries only the JSON result (machine-readable); the table for people goes to stderr. `--pods all`
replays every pod list in the directory and `--ties both` both tie regimes; the runs (one per list, regime,
policy and seed) are spread over `--jobs` processes. A policy that does not use the tie regime runs once and
is reported under both.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import re
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, TypeVar

from agent.allocation.fragmentation import RequestMix
from agent.commands.options import SettingError
from agent.simulation.replay import (
    PAPER_SEEDS,
    TIE_REGIMES,
    TraceNode,
    parse_nodes,
    parse_pods,
    replay_run,
    typical_mix,
)
from agent.simulation.trace_policies import TracePod, baseline_policies

T = TypeVar("T")

ALL_POLICIES = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "ours")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-dir", required=True, type=pathlib.Path, help="directory with the openb CSV files")
    parser.add_argument(
        "--pods",
        default="openb_pod_list_default.csv",
        help="pod list file in --trace-dir, or `all` for every openb_pod_list_*.csv there",
    )
    parser.add_argument("--nodes", default="openb_node_list_gpu_node.csv", help="node list file in --trace-dir")
    parser.add_argument(
        "--policy",
        default=",".join(ALL_POLICIES),
        help=f"comma-separated policies (default all: {','.join(ALL_POLICIES)}; also `near`, "
        "the alternative DESIGN.md compares)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=len(PAPER_SEEDS),
        help="number of seeds, 42, 43, ... (default 10); the median is reported",
    )
    parser.add_argument(
        "--ties",
        choices=(*TIE_REGIMES, "both"),
        default="fixed",
        help="fixed: one random node order per run (the paper); random: per pod (kube-scheduler); both: each",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="processes to spread the runs over (default: one per CPU)"
    )


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message starts with `file:line:` where there is a line."""


def _read_csv(path: pathlib.Path, parse: Callable[[list[dict[str, str]]], list[T]]) -> list[T]:
    """Parse each row on its own, so an error names the file and line it is on."""
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header:
            raise TraceError(f"{path}: empty, expected a CSV header line")
        parsed: list[T] = []
        for row in reader:
            line = reader.line_num
            if not row:
                continue
            if len(row) != len(header):
                raise TraceError(f"{path}:{line}: {len(row)} fields where the header has {len(header)}")
            try:
                parsed += parse([dict(zip(header, row, strict=True))])
            except ValueError as e:
                raise TraceError(f"{path}:{line}: {e}") from None
    return parsed


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise TraceError(f"--policy names no policy ({text!r}); choose from {','.join(ALL_POLICIES)}")
    return names


POD_LIST = re.compile(r"openb_pod_list_(.+)\.csv")


def _pod_lists(trace_dir: pathlib.Path, pods: str) -> list[pathlib.Path]:
    """The pod list files to replay: one, or with `all` every openb list, default first, then by name."""
    if pods != "all":
        return [trace_dir / pods]
    found = sorted(
        trace_dir.glob("openb_pod_list_*.csv"), key=lambda p: (p.name != "openb_pod_list_default.csv", p.name)
    )
    if not found:
        raise TraceError(f"{trace_dir}: no openb_pod_list_*.csv files")
    return found


def _short(path: pathlib.Path) -> str:
    match = POD_LIST.fullmatch(path.name)
    return match.group(1) if match else path.name


# One run = (pod list, node list, policy, seed, tie regime). Each process reads a file once; workers forked
# after `run` read them inherit what it read.
_Run = tuple[str, str, str, int, str]
_nodes_read: dict[str, list[TraceNode]] = {}
_pods_read: dict[str, tuple[list[TracePod], RequestMix]] = {}


def _trace(pods_path: str, nodes_path: str) -> tuple[list[TraceNode], list[TracePod], RequestMix]:
    if nodes_path not in _nodes_read:
        _nodes_read[nodes_path] = _read_csv(pathlib.Path(nodes_path), parse_nodes)
    if pods_path not in _pods_read:
        pods = _read_csv(pathlib.Path(pods_path), parse_pods)
        _pods_read[pods_path] = (pods, typical_mix(pods))
    return (_nodes_read[nodes_path], *_pods_read[pods_path])


def _replay_run(run: _Run) -> float:
    pods_path, nodes_path, policy, seed, ties = run
    return replay_run(*_trace(pods_path, nodes_path), policy, seed, ties=ties)


def _results(runs: list[_Run], jobs: int) -> list[float]:
    if jobs <= 1 or len(runs) == 1:
        return [_replay_run(r) for r in runs]
    with ProcessPoolExecutor(max_workers=min(jobs, len(runs))) as pool:
        return list(pool.map(_replay_run, runs, chunksize=1))


def _entry(vals: list[float]) -> dict[str, Any]:
    return {
        "unallocatedGpuPercent": round(statistics.median(vals), 2),
        "seeds": len(vals),
        "perSeed": [round(v, 2) for v in vals],
    }


def _print_table(regime: str, by_list: dict[str, dict[str, list[float]]], names: list[str]) -> None:
    """Median unallocated GPU % per list (rows) and policy (columns); with fgd and ours, the paired
    per-seed difference ours - fgd and on how many seeds ours was lower."""
    paired = [n for n in ("ours", "near") if n in names] if "fgd" in names else []
    head = f"{'pod list':<14}" + "".join(f"{n:>11}" for n in names)
    head += "".join(f"{n + '-fgd':>10}{'wins':>7}" for n in paired)
    print(f"\nties {regime}: unallocated GPU % at 100 % arrived, median over seeds", file=sys.stderr)
    print(head, file=sys.stderr)
    for name, results in by_list.items():
        row = f"{name:<14}" + "".join(f"{statistics.median(results[n]):>11.2f}" for n in names)
        for ours in paired:
            diffs = [o - f for o, f in zip(results[ours], results["fgd"], strict=True)]
            row += f"{statistics.fmean(diffs):>+10.2f}{sum(d < 0 for d in diffs):>4}/{len(diffs)}"
        print(row, file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        names = _policies(str(args.policy))
    except TraceError as e:
        raise SettingError(str(e)) from None
    if args.seeds < 1:
        raise SettingError("--seeds must be at least 1")
    if args.jobs < 1:
        raise SettingError("--jobs must be at least 1")
    regimes = list(TIE_REGIMES) if args.ties == "both" else [str(args.ties)]
    try:
        lists = _pod_lists(args.trace_dir, str(args.pods))
        nodes_path = args.trace_dir / args.nodes
        for path in lists:  # every file is read (and checked) here, before any run starts
            nodes, _, mix = _trace(str(path), str(nodes_path))
        policies = baseline_policies(mix)  # the same names and tie rules whatever the list
    except TraceError as e:
        raise SettingError(f"bad trace: {e}") from None
    except OSError as e:
        raise SettingError(f"cannot read the trace: {e.strerror}: {e.filename}") from None
    except (ValueError, csv.Error) as e:  # csv.Error: a malformed quote or a NUL byte
        raise SettingError(f"bad trace: {e}") from None
    unknown = [p for p in names if p not in policies]
    if unknown:
        raise SettingError(f"unknown policy {', '.join(unknown)}: choose from {', '.join(policies)}")
    if not nodes or not any(n.gpu_count for n in nodes):
        raise SettingError("bad trace: the node list has no GPUs")
    seeds = [PAPER_SEEDS[0] + i for i in range(args.seeds)]
    # a policy that settles ties itself gives the same placements under every regime: run it once
    regime_of = {n: regimes if policies[n].tie_rule == "regime" else regimes[:1] for n in names}
    runs = [
        (str(path), str(nodes_path), name, seed, regime)
        for path in lists
        for name in names
        for regime in regime_of[name]
        for seed in seeds
    ]
    started = time.monotonic()
    try:
        got = dict(zip(runs, _results(runs, args.jobs), strict=True))
    except ValueError as e:
        raise SettingError(str(e)) from None
    took = time.monotonic() - started

    def per_seed(path: pathlib.Path, name: str, regime: str) -> list[float]:
        ran = regime if regime in regime_of[name] else regime_of[name][0]
        return [got[(str(path), str(nodes_path), name, seed, ran)] for seed in seeds]

    table = {
        regime: {_short(path): {name: per_seed(path, name, regime) for name in names} for path in lists}
        for regime in regimes
    }
    if len(lists) == 1 and len(regimes) == 1:  # one list, one regime: the policies at the top level
        out: dict[str, Any] = {name: _entry(vals) for name, vals in table[regimes[0]][_short(lists[0])].items()}
    else:
        out = {
            regime: {lst: {name: _entry(vals) for name, vals in by.items()} for lst, by in by_list.items()}
            for regime, by_list in table.items()
        }
    print(json.dumps(out))
    sys.stdout.flush()
    print(
        f"\n{len(lists)} pod list(s), {len(names)} policies, {len(seeds)} seeds, ties {args.ties}: "
        f"{len(runs)} runs on {min(args.jobs, len(runs))} process(es), {took:.1f} s",
        file=sys.stderr,
    )
    if len(lists) == 1:
        for regime in regimes:
            results = table[regime][_short(lists[0])]
            print(f"\n{lists[0].name}, ties {regime}", file=sys.stderr)
            print(f"{'policy':<12}{'unallocated GPU % (median)':>28}{'min':>8}{'max':>8}", file=sys.stderr)
            for name, vals in results.items():
                print(f"{name:<12}{statistics.median(vals):>28.2f}{min(vals):>8.2f}{max(vals):>8.2f}", file=sys.stderr)
    else:
        for regime in regimes:
            _print_table(regime, table[regime], names)
    return 0
