"""The demo's MIG relabel: what an operator does (`kubectl label node N nvidia.com/mig.config=...`) and sees
(the state label going pending -> success, the node's Event, the devices in the slices before and after)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from agent.jsontypes import Json
from agent.migconfig.reconciler import CONFIG_LABEL, STATE_LABEL
from fakes.demo import report
from fakes.demo.kubectl import Kubectl
from fakes.demo.node import DemoError

END_STATES = ("success", "failed", "rebooting")


def summary(slices: list[Json]) -> str:
    """`8 devices: 8x NVIDIA H100 80GB HBM3` / `56 devices: 56x 1g.10gb`."""
    rows = report.device_rows(slices)
    kinds = Counter(row[2] for row in rows)
    return f"{len(rows)} devices: " + ", ".join(f"{n}x {what}" for what, n in sorted(kinds.items()))


def relabel(
    kubectl: Kubectl, node: str, value: str, slices: Callable[[], list[Json]], timeout: float = 60.0
) -> list[str]:
    """Label the node, wait for the agent to reach an end state, and say what happened."""
    before = summary(slices())
    seen = {e["metadata"]["name"] for e in kubectl.list("Event")}
    t0 = time.monotonic()
    kubectl.label("Node", node, {CONFIG_LABEL: value})
    states: list[str] = []
    deadline = t0 + timeout
    while True:
        state = (kubectl.get("Node", node)["metadata"].get("labels") or {}).get(STATE_LABEL, "")
        if state and state not in states[-1:]:
            states.append(state)
        fresh = [
            e
            for e in kubectl.list("Event")
            if e["metadata"]["name"] not in seen
            and e["involvedObject"]["name"] == node
            and e["reason"] != "MigConfigPending"
        ]
        if state in END_STATES and any(e["reason"] != "MigConfigWaiting" for e in fresh):
            break
        if time.monotonic() > deadline:
            raise DemoError(f"{node} did not reach a MIG end state for {value} in {timeout:.0f}s (states {states})")
        time.sleep(0.05)
    took = time.monotonic() - t0
    last = max(fresh, key=lambda e: e["metadata"]["name"])
    return [
        f"  kubectl label node {node} {CONFIG_LABEL}={value}",
        f"    {STATE_LABEL}: {' -> '.join(states)} in {took:.2f}s",
        f"    event {last['reason']}: {last['message']}",
        f"    before: {before}",
        f"    after:  {summary(slices())}",
    ]
