"""kube-scheduler 1.37's PodGroup condition on the real control plane: what the arbiter's mark relies on.

kube-scheduler schedules a PodGroup's pods as one group and then writes the group's `PodGroupInitiallyScheduled`
condition inside its scheduling loop (one API round trip per group before it takes up the next), unless the
condition is already there word for word. The arbiter writes it when it admits a gang (Committer.mark_scheduled);
if a kube-scheduler release worded it differently, this test says so.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from agent.arbiter.commit import Committer, scheduled_condition
from agent.kube.rest import POD_GROUPS, PODS, Rest
from fakes.cluster import wait_for

pytestmark = pytest.mark.controlplane
NS = "pod-groups"


def _group(rest: Rest, name: str) -> dict[str, Any]:
    return rest.create(
        POD_GROUPS,
        NS,
        {
            "apiVersion": "scheduling.k8s.io/v1beta1",
            "kind": "PodGroup",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}},
        },
    )


def _members(rest: Rest, group: str) -> None:
    for i in range(2):
        rest.create(
            PODS,
            NS,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"{group}-{i}", "namespace": NS},
                "spec": {
                    "containers": [{"name": "main", "image": "trainer:1"}],
                    "schedulingGroup": {"podGroupName": group},
                },
            },
        )


def _status_writers(group: dict[str, Any]) -> set[str]:
    return {e["manager"] for e in group["metadata"].get("managedFields") or () if e.get("subresource") == "status"}


def test_kube_scheduler_leaves_a_podgroup_marked_as_the_arbiter_marks_it(control_plane: Any) -> None:
    from tests.controlplane.cluster import reset

    reset(control_plane)
    rest = control_plane.rest()
    try:
        control_plane.add_node("pod-group-node")
        control_plane.request(
            "POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
        )
        committer = Committer(rest, "gpu.nvidia.com", dict, ttl_seconds=30, clock=time.time)
        try:
            committer.mark_scheduled(_group(rest, "marked"))  # as the arbiter does when it admits the gang
        finally:
            committer.close()
        marked = rest.get(POD_GROUPS, NS, "marked")
        _group(rest, "unmarked")  # tried: the same group left to kube-scheduler alone
        for name in ("marked", "unmarked"):
            _members(rest, name)
        wait_for(
            lambda: all(p["spec"].get("nodeName") for p in rest.list(PODS, NS)["items"]),
            timeout=60,
            what="both groups bound by kube-scheduler",
        )
        unmarked = wait_for(
            lambda: g if scheduled_condition(g := rest.get(POD_GROUPS, NS, "unmarked")) else None,
            timeout=30,
            what="kube-scheduler's own mark",
        )
        ours, theirs = scheduled_condition(marked), scheduled_condition(unmarked)
        assert ours is not None and theirs is not None
        assert {k: v for k, v in ours.items() if k != "lastTransitionTime"} == {
            k: v for k, v in theirs.items() if k != "lastTransitionTime"
        }  # word for word
        assert "kube-scheduler" in _status_writers(unmarked)
        after = rest.get(POD_GROUPS, NS, "marked")
        assert after["metadata"]["resourceVersion"] == marked["metadata"]["resourceVersion"]  # nothing written
        assert "kube-scheduler" not in _status_writers(after)
    finally:
        for pod in rest.list(PODS, NS)["items"]:  # bound to a node with no kubelet: forced
            rest.delete(PODS, NS, pod["metadata"]["name"], grace_period_s=0)
        reset(control_plane)
