"""Arbiter metrics: values computed from a cycle, and what prometheus_client then exposes."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from agent.arbiter.metrics import ArbiterMetrics, cycle_values
from tests.unit.test_arbiter_support import cycle, doc, gang, node, queue

CREATED = 1735689600.0  # 2025-01-01T00:00:00Z


def scenario() -> dict[str, object]:
    # fair shares of 11 GPUs: a 4 + 2 over quota, b 2 (its demand), c 3 (quota, no weight)
    queues = [queue("a", quota=4), queue("b", quota=4), queue("c", quota=3, weight=0)]
    jobs = [
        gang("ja", "a", 8, node="n1", min_member=1),
        gang("jb", "b", 2),
        gang("low", "c", 2, node="n2", priority=10),
        gang("high", "c", 2, priority=60),
        gang("ok", "c", 1, created="2025-01-01T00:10:00Z"),
    ]
    return doc([node("n1", 8), node("n2", 3)], queues, jobs)


def test_values_follow_the_cycle() -> None:
    result = cycle(scenario())
    values = cycle_values(result, now=CREATED + 900, cycle_seconds=0.25)
    assert values.reclaims == {"a": 2}
    assert values.preemptions == {"c": 2}
    assert values.fair_share[("b", "gpu")] == 2
    assert values.allocated[("a", "gpu")] == 6  # 8 running minus 2 reclaimed
    assert values.queue_depth == {"a": 0, "b": 0, "c": 1}  # "low" was preempted and waits again
    # "ok" (created 5 min before now) bound on n2's free GPU: admitted after 300 s; pipelined gangs are not
    assert values.admission_waits == (("c", 300.0),)
    assert values.cycle_seconds == 0.25


def test_exposition_has_the_documented_names_and_labels() -> None:
    registry = CollectorRegistry()
    metrics = ArbiterMetrics(registry)
    metrics.record(cycle_values(cycle(scenario()), now=CREATED + 900, cycle_seconds=0.25))
    text = generate_latest(registry).decode()
    assert 'gpu_arbiter_queue_depth{queue="c"} 1.0' in text
    assert 'gpu_arbiter_fair_share{queue="b",resource="gpu"} 2.0' in text
    assert 'gpu_arbiter_allocated{queue="a",resource="gpu"} 6.0' in text
    assert 'gpu_arbiter_reclaims_total{queue="a"} 2.0' in text
    assert 'gpu_arbiter_preemptions_total{queue="c"} 2.0' in text
    assert 'gpu_arbiter_time_to_admission_seconds_count{queue="c"} 1.0' in text
    assert "gpu_arbiter_cycle_duration_seconds_count 1.0" in text
