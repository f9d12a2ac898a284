"""kube-scheduler's message for a pod no node can take, so the arbiter's wait reasons read as the scheduler's do.

kube-scheduler 1.37 (pkg/scheduler/framework/types.go, FitError.Error) writes "0/<all nodes> nodes are available:",
then " <count> <reason>" for each distinct reason of the nodes that refused the pod, joined by ", " and sorted as
whole strings (Go's sort.Strings, count first, so "10 ..." comes before "2 ..."), then "."; a PostFilter's
message follows after a space, e.g. DefaultPreemption's "preemption: " + its own FitError, whose nodes where
evicting could not help say "Preemption is not helpful for scheduling". Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

NOT_HELPFUL = "Preemption is not helpful for scheduling"  # preemption.go: nodes preemption cannot help
NO_VICTIMS = "No preemption victims found for incoming pod"  # default_preemption.go: nothing could be evicted


def fit_error(nodes: int, refusals: Mapping[str, int], post_filter: str = "") -> str:
    """The message for `nodes` nodes of which each reason of `refusals` refused as many; a PostFilter's
    message (e.g. `preemption(...)`) after it."""
    reasons = sorted(f"{count} {why}" for why, count in refusals.items() if count)
    text = f"0/{nodes} nodes are available:" + (f" {', '.join(reasons)}." if reasons else "")
    return f"{text} {post_filter}" if post_filter else text


def preemption(nodes: int, refusals: Mapping[str, int]) -> str:
    """DefaultPreemption's PostFilter message when it found no candidate."""
    return f"preemption: {fit_error(nodes, refusals)}"
