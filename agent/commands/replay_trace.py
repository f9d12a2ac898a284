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

from agent.allocation.replay import PAPER_SEEDS, TIE_REGIMES, parse_nodes, parse_pods, replay

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


def _read_csv(path: pathlib.Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def run(args: argparse.Namespace) -> int:
    names = [p.strip() for p in str(args.policy).split(",") if p.strip()]
    if args.seeds < 1:
        print("--seeds must be at least 1", file=sys.stderr)
        return 2
    try:
        nodes = parse_nodes(_read_csv(args.trace_dir / args.nodes))
        pods = parse_pods(_read_csv(args.trace_dir / args.pods))
    except OSError as e:
        print(f"cannot read the trace: {e.strerror}: {e.filename}", file=sys.stderr)
        return 2
    except ValueError as e:
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
