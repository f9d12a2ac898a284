"""Snapshot parsing: the documented format is accepted; each kind of bad snapshot is one clear error."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from agent.arbiter.core.model import MILLI
from agent.arbiter.core.snapshot import SnapshotError, parse_snapshot
from tests.unit.test_arbiter_support import doc, gang, job, node, pod, queue


def good() -> dict[str, Any]:
    return doc(
        [node("n1", 8, labels={"zone": "a"}, nvlinkDomains=[[0, 1, 2, 3], [4, 5, 6, 7]], gpuModel="H100")],
        [queue("dept"), queue("team", parent="dept", quota=2.5, cpu={"quota": 100, "limit": -1, "overQuotaWeight": 1})],
        [job("j", "team", [pod("p0", 0.5, "n1", gpuIndex=3), pod("p1", 2, taskPriority=5)], min_member=1)],
        gpu="spread",
    )


def test_the_documented_format_parses_into_the_model() -> None:
    snapshot = parse_snapshot(good())
    assert snapshot.placement.gpu == "spread" and snapshot.placement.cpu == "binpack"
    assert snapshot.nodes[0].nvlink_domains == ((0, 1, 2, 3), (4, 5, 6, 7))
    team = snapshot.queues[1]
    assert team.parent == "dept" and team.terms[0].quota == 2.5 * MILLI and team.terms[1].quota == 100
    first = snapshot.jobs[0].pods[0]
    assert first.gpu_milli == 500 and first.gpu_index == 3 and first.status == "Running"
    assert snapshot.jobs[0].created_at == 1735689600.0


def test_gpus_are_placed_by_fragmentation_unless_the_snapshot_says_otherwise() -> None:
    document = good()
    del document["config"]
    assert parse_snapshot(document).placement.gpu == "fgd"


def edit(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    document = copy.deepcopy(good())
    change(document)
    return document


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(d: dict[str, Any]) -> None:
        *head, last = path.split(".")
        target: Any = d
        for key in head:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value

    return change


BAD = {
    "unknown queue": (_set("jobs.0.queue", "nope"), "unknown queue 'nope'"),
    "job in a parent queue": (_set("jobs.0.queue", "dept"), "parent queue"),
    "negative node GPUs": (_set("nodes.0.gpus", -1), "negative gpus"),
    "negative pod CPU": (_set("jobs.0.pods.1.cpuMilli", -5), "negative cpuMilli"),
    "negative quota": (_set("queues.1.gpu.quota", -2), "negative quota"),
    "negative weight": (_set("queues.1.gpu.overQuotaWeight", -3), "negative overQuotaWeight"),
    "cycle in the queue tree": (_set("queues.0.parent", "team"), "cycle"),
    "unknown parent": (_set("queues.1.parent", "ghost"), "unknown parent queue 'ghost'"),
    "duplicate queue": (_set("queues.1.name", "dept"), "queue name 'dept' appears more than once"),
    "duplicate pod": (_set("jobs.0.pods.1.name", "p0"), "pod name 'p0' appears more than once"),
    "malformed timestamp": (_set("jobs.0.createdAt", "yesterday"), "malformed createdAt"),
    "timestamp without zone": (_set("jobs.0.createdAt", "2025-01-01T00:00:00"), "time zone"),
    "unknown node": (_set("jobs.0.pods.0.node", "ghost"), "unknown node 'ghost'"),
    "running pod without node": (_set("jobs.0.pods.0.node", None), "only pending pods have no node"),
    "bad status": (_set("jobs.0.pods.0.status", "Done"), "status 'Done'"),
    "GPU index out of range": (_set("jobs.0.pods.0.gpuIndex", 8), "lacks"),
    "fractional GPUs above one": (_set("jobs.0.pods.1.gpus", 1.5), "whole number or a fraction"),
    "bad placement policy": (_set("config.placement.gpu", "random"), "fgd or binpack or spread, not 'random'"),
    "fgd for CPU": (_set("config.placement.cpu", "fgd"), "cpu must be binpack or spread"),
    "nodes not a list": (_set("nodes", {}), "needs a list 'nodes'"),
    "domain index twice": (_set("nodes.0.nvlinkDomains", [[0, 1], [1, 2]]), "nvlinkDomains"),
    "string quantity": (_set("nodes.0.cpuMilli", "lots"), "must be a number"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_bad_snapshot_is_rejected_with_one_sentence_naming_the_problem(case: str) -> None:
    change, words = BAD[case]
    with pytest.raises(SnapshotError) as err:
        parse_snapshot(edit(change))
    message = str(err.value)
    assert words in message
    assert message.endswith(".") and "\n" not in message


def test_running_pods_that_overfill_a_node_are_rejected() -> None:
    # trying to load 3 running one-GPU pods on a 2-GPU node
    from agent.arbiter.core.cycle import run_cycle

    document = doc([node("n", 2)], [queue("q")], [gang("g", "q", 3, node="n")])
    with pytest.raises(SnapshotError, match="does not fit on node 'n'"):
        run_cycle(parse_snapshot(document))


def test_missing_optional_fields_take_documented_defaults() -> None:
    document = {
        "nodes": [{"name": "n", "gpus": 1, "cpuMilli": 1, "memBytes": 1}],
        "queues": [
            {"name": "q", "parent": None, "priority": 100, "gpu": {"quota": 1, "limit": -1, "overQuotaWeight": 1}}
        ],
        "jobs": [
            {
                "name": "j",
                "queue": "q",
                "priority": 125,
                "createdAt": "2025-01-01T00:00:00+02:00",
                "pods": [{"name": "p", "gpus": 1, "cpuMilli": 0, "memBytes": 0, "node": None, "status": "Pending"}],
            }
        ],
    }
    snapshot = parse_snapshot(document)
    assert snapshot.jobs[0].preemptible is False  # priority >= 100
    assert snapshot.jobs[0].min_member == 1
    assert snapshot.queues[0].terms[1].quota == -1  # no cpu block: unlimited
