"""kube-scheduler's FitError message as the arbiter writes it (agent.arbiter.fit_error), checked against the
order Go's sort.Strings gives the "<count> <reason>" strings in pkg/scheduler/framework/types.go."""

from __future__ import annotations

from agent.arbiter.fit_error import NOT_HELPFUL, fit_error, preemption


def test_reasons_sort_as_whole_strings_count_first() -> None:
    """Tried: 10 nodes under one reason and 2 under another: "10 ..." sorts before "2 ...", as in Go."""
    assert fit_error(12, {"node(s) had untolerated taint(s)": 2, "Insufficient nvidia.com/gpu": 10}) == (
        "0/12 nodes are available: 10 Insufficient nvidia.com/gpu, 2 node(s) had untolerated taint(s)."
    )


def test_a_post_filter_message_follows_and_empty_counts_are_left_out() -> None:
    """Tried: a reason counted 0 times, and DefaultPreemption's message after the filters'."""
    assert fit_error(
        3, {"cannot allocate all claims": 3, "node(s) were unschedulable": 0}, preemption(3, {NOT_HELPFUL: 3})
    ) == (
        "0/3 nodes are available: 3 cannot allocate all claims. "
        "preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling."
    )
