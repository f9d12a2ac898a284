"""Reclaim within one burst (issue 18): a job admitted while the reclaimer was already waiting is not its
victim for SAME_BURST_S (no thrash), and is one afterwards (no starvation); one admitted before it is. The same
holds for consolidation moves."""

from __future__ import annotations

from typing import Any

from agent.arbiter.core.evict import SAME_BURST_S
from tests.unit.test_arbiter_support import cycle, doc, gang, job, node, pod, queue

WAITING_SINCE = "2025-01-01T12:00:00Z"


def _doc(started: str, now: str) -> dict[str, Any]:
    queues = [queue("a", quota=0), queue("b", quota=4, weight=0)]
    victim = job("ja", "a", [pod(f"ja-{i}", 1, "n") for i in range(4)])
    victim["startedAt"] = started
    document = doc([node("n", 4)], queues, [victim, gang("want", "b", 2, created=WAITING_SINCE)])
    document["now"] = now
    return document


def _evicted(document: dict[str, Any]) -> int:
    return sum(1 for d in cycle(document, "reclaim").pods.values() if d.action == "evict")


def test_a_job_admitted_while_the_reclaimer_waited_is_spared_for_the_burst_then_taken() -> None:
    assert SAME_BURST_S == 30.0
    assert _evicted(_doc(started="2025-01-01T12:00:01Z", now="2025-01-01T12:00:05Z")) == 0
    assert _evicted(_doc(started="2025-01-01T12:00:01Z", now="2025-01-01T12:00:40Z")) == 4


def test_a_job_admitted_before_the_reclaimer_arrived_is_taken_at_once() -> None:
    assert _evicted(_doc(started="2025-01-01T11:59:59Z", now="2025-01-01T12:00:05Z")) == 4


def _consolidation_doc(started: str) -> dict[str, Any]:
    nodes = [node("n1", 4), node("n2", 4)]
    a = gang("a", "q", 1, node="n1", gpus=2)
    b = gang("b", "q", 1, node="n2", gpus=1)
    for j in (a, b):
        j["startedAt"] = started
    document = doc(nodes, [queue("q")], [a, b, gang("big", "q", 1, gpus=4, created=WAITING_SINCE)])
    document["now"] = "2025-01-01T12:00:05Z"
    return document


def test_consolidation_moves_no_job_admitted_while_the_gang_waited() -> None:
    def moved(started: str) -> int:
        return sum(
            1 for d in cycle(_consolidation_doc(started), "allocate,consolidate").pods.values() if d.action == "evict"
        )

    assert moved("2025-01-01T12:00:01Z") == 0
    assert moved("2025-01-01T11:59:00Z") == 1
