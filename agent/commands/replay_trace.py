"""`gpu-dra-agent replay-trace`: replay an openb trace under placement policies, side by side.

stdout carries only the JSON result (machine-readable); the table for people goes to stderr.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from agent.allocation.replay import PAPER_SEEDS, TIE_REGIMES, parse_nodes, parse_pods, replay

T = TypeVar("T")

ALL_POLICIES = ("random", "dotprod", "clustering", "packing", "bestfit", "fgd", "ours")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace-dir", required=True, type=pathlib.Path,
                        help="directory with the openb CSV files")
    parser.add_argument("--pods", default="openb_pod_list_default.csv", help="pod list file in --trace-dir")
    parser.add_argument("--nodes", default="openb_node_list_gpu_node.csv", help="node list file in --trace-dir")
    parser.add_argument("--policy", default=",".join(ALL_POLICIES),
                        help=f"comma-separated policies (default all: {','.join(ALL_POLICIES)})")
    parser.add_argument("--seeds", type=int, default=len(PAPER_SEEDS),
                        help="number of seeds, 42, 43, ... (default 10); the median is reported")
    parser.add_argument("--ties", choices=TIE_REGIMES, default="fixed",
                        help="fixed: one random node order per run (the paper); random: per pod (kube-scheduler)")


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


def run(args: argparse.Namespace) -> int:
    try:
        names = _policies(str(args.policy))
    except TraceError as e:
        print(e, file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("--seeds must be at least 1", file=sys.stderr)
        return 2
    try:
        nodes = _read_csv(args.trace_dir / args.nodes, parse_nodes)
        pods = _read_csv(args.trace_dir / args.pods, parse_pods)
    except OSError as e:
        print(f"cannot read the trace: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except (ValueError, csv.Error) as e:  # csv.Error: a malformed quote or a NUL byte
        print(f"bad trace: {e}", file=sys.stderr)
        return 2
    seeds = [PAPER_SEEDS[0] + i for i in range(args.seeds)]
    started = time.monotonic()
    try:
        results = replay(nodes, pods, names, seeds, args.ties)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    out = {name: {"unallocatedGpuPercent": round(statistics.median(vals), 2), "seeds": len(vals),
                  "perSeed": [round(v, 2) for v in vals]}
           for name, vals in results.items()}
    print(json.dumps(out))
    sys.stdout.flush()
    print(f"\n{args.pods}, ties {args.ties}, {len(seeds)} seeds, {time.monotonic() - started:.1f} s",
          file=sys.stderr)
    print(f"{'policy':<12}{'unallocated GPU % (median)':>28}{'min':>8}{'max':>8}", file=sys.stderr)
    for name, vals in results.items():
        print(f"{name:<12}{statistics.median(vals):>28.2f}{min(vals):>8.2f}{max(vals):>8.2f}", file=sys.stderr)
    return 0
