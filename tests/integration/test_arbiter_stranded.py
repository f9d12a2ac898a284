"""A child Queue created under a leaf that has pending pods makes it a parent, and only leaf queues take pods (KAI:
JobsOrderByQueues skips a job whose queue has children). Those pods then wait. Both Queues reported
`Valid=True` and nothing said why (issue 33, item 5). Now the former leaf and the child that made it a parent
both carry the condition `PodsStranded`, with the count of pods it stranded, and it goes once the child does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agent.arbiter.controller import ArbiterConfig
from agent.kube.rest import QUEUES
from agent.names import GATE
from fakes.cluster import FakeCluster, wait_for

pytestmark = pytest.mark.slow
NS = "team-a"


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(nodes=1) as c:
        c.queue("root")
        c.queue("good", parent="root", gpu_quota=8)
        yield c


def _conditions(cluster: FakeCluster, name: str) -> dict[str, dict[str, Any]]:
    status = cluster.rest.get(QUEUES, None, name).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or ()}


def _gated(cluster: FakeCluster) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in cluster.pods()
        if any(g.get("name") == GATE for g in p["spec"].get("schedulingGates") or ())
    )


def test_a_child_queue_under_a_leaf_with_pending_pods_is_told_on_both_queues(cluster: FakeCluster) -> None:
    cluster.queue("bad", parent="good", gpu_quota=1)
    for name in ("p1", "p2", "p3"):
        cluster.pod(NS, name, "good", 1)
    arbiter = cluster.arbiter(ArbiterConfig(period_s=0.2, status_period_s=0.0), start=False)
    report = wait_for(lambda: (r := arbiter.cycle()).waiting.get(f"{NS}/pod/p3") and r, what="the pods weighed")
    assert report.admitted == [] and _gated(cluster) == ["p1", "p2", "p3"]  # KAI: they stay where they are
    assert report.waiting[f"{NS}/pod/p1"] == (
        "queue good is a parent queue (of bad); only leaf queues take pods: "
        "the gang waits until it names a leaf queue or good has no child "
        "queue again"
    )
    good = wait_for(lambda: _conditions(cluster, "good").get("PodsStranded"), what="the former leaf's condition")
    assert (good["status"], good["reason"]) == ("True", "ParentQueueHasPods")
    assert good["message"].startswith("3 pending pod(s) name queue good, a parent queue since bad named it")
    bad = _conditions(cluster, "bad")["PodsStranded"]
    assert (bad["status"], bad["reason"]) == ("True", "MadeParentOfPods")
    assert bad["message"].startswith("this queue made good a parent queue, and 3 pending pod(s) name queue good")
    assert _conditions(cluster, "good")["Valid"]["status"] == "True"  # the Queues themselves are valid

    cluster.rest.delete(QUEUES, None, "bad")  # good is a leaf again: its pods are admitted, the condition goes
    wait_for(lambda: arbiter.cycle().admitted and not _gated(cluster), what="the pods admitted")
    wait_for(lambda: arbiter.cycle() and "PodsStranded" not in _conditions(cluster, "good"), what="the condition gone")
