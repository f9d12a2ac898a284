"""The API objects as the arbiter core's snapshot: queues, gangs from PodGroups, pod states, node capacity,
claims as reservation requests, and the allocation written back."""

from __future__ import annotations

from typing import Any

import pytest

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.snapshot import go_duration as parse_duration
from agent.arbiter.queue_usage import held
from agent.arbiter.world import build_world
from agent.names import ADDRESS_ANNOTATION, ADMITTED_ANNOTATION, FINGERPRINT_ANNOTATION, GATE, QUEUE_LABEL
from agent.objects.write import Unsupported, allocation_status, reservation_claim
from agent.times import parse_rfc3339 as parse_time

DRIVER = "gpu.nvidia.com"
NOW = 1_800_000_000.0


def queue(name: str, parent: str | None = None, gpu_quota: float = 0, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"resources": {"gpu": {"quota": gpu_quota, "limit": -1, "overQuotaWeight": 1}}, **spec}
    if parent:
        body["parentQueue"] = parent
    return {"metadata": {"name": name}, "spec": body}


def node(name: str, gpus: int = 8) -> tuple[dict[str, Any], dict[str, Any]]:
    n = {
        "metadata": {
            "name": name,
            "annotations": {ADDRESS_ANNOTATION: f"{name}:7000", FINGERPRINT_ANNOTATION: "ab" * 32},
        },
        "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
    }
    s = {
        "metadata": {"name": f"{name}-gpu"},
        "spec": {
            "driver": DRIVER,
            "nodeName": name,
            "pool": {"name": name, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(gpus)],
        },
    }
    return n, s


def claim(
    name: str,
    count: int = 1,
    allocated_on: str | None = None,
    devices: tuple[str, ...] = (),
    reserved_for: str | None = None,
) -> dict[str, Any]:
    c: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": count}}]
            }
        },
    }
    if allocated_on:
        c["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": "gpus", "driver": DRIVER, "pool": allocated_on, "device": d} for d in devices
                    ]
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [allocated_on]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": reserved_for, "uid": f"uid-{reserved_for}"}]
            if reserved_for
            else [],
        }
    return c


def pod(
    name: str,
    claim_name: str,
    *,
    group: str | None = None,
    gated: bool = True,
    node_name: str | None = None,
    queue_name: str | None = "team-a",
    **meta: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
    }
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    if node_name:
        spec["nodeName"] = node_name
    labels = {QUEUE_LABEL: queue_name} if queue_name else {}
    return {
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "uid": f"uid-{name}",
            "labels": labels,
            "creationTimestamp": "2027-01-15T08:00:00Z",
            **meta,
        },
        "spec": spec,
    }


def pod_group(name: str, min_count: int, **labels: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "team-a",
            "labels": labels,
            "creationTimestamp": "2027-01-15T07:00:00Z",
        },
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
    }


def world(
    pods: list[Any],
    claims: list[Any],
    groups: list[Any] = (),
    queues: list[Any] | None = None,
    nodes: int = 2,
    gpus: int = 8,
    built: list[tuple[dict[str, Any], dict[str, Any]]] | None = None,
    in_flight: dict[str, str] | None = None,
) -> Any:
    """The world of these objects on `nodes` nodes of `gpus` GPUs, or on `built` (node(...)s changed first)."""
    built = built if built is not None else [node(f"n{i}", gpus) for i in range(nodes)]
    return build_world(
        pods=pods,
        claims=claims,
        pod_groups=groups,
        queues=queues if queues is not None else [queue("root"), queue("team-a", "root", 8)],
        nodes=[n for n, _ in built],
        slices=[s for _, s in built],
        driver=DRIVER,
        now=NOW,
        in_flight=in_flight,
    )


def test_a_pod_group_is_one_gang_of_gated_pods_in_its_queue() -> None:
    w = world(
        [pod("w0", "c0", group="train"), pod("w1", "c1", group="train")],
        [claim("c0", 8), claim("c1", 8)],
        [pod_group("train", 2)],
    )
    (job,) = w.snapshot.jobs
    assert (job.name, job.queue, job.min_member) == ("team-a/train", "team-a", 2)
    assert [(p.name, p.gpu_milli, p.status, p.cpu_milli) for p in job.pods] == [
        ("team-a/w0", 8000, "Pending", 2000.0),
        ("team-a/w1", 8000, "Pending", 2000.0),
    ]
    assert {n.name: n.gpus for n in w.snapshot.nodes} == {"n0": 8, "n1": 8}
    assert w.snapshot.queues[1].terms[0].quota == 8000  # GPU quota in devices -> milli-GPUs


def test_the_queue_label_may_sit_on_the_pod_group() -> None:
    w = world(
        [pod("w0", "c0", group="train", queue_name=None)],
        [claim("c0")],
        [pod_group("train", 1, **{QUEUE_LABEL: "team-a"})],
    )
    assert [j.queue for j in w.snapshot.jobs] == ["team-a"]


def test_running_pods_hold_their_devices_and_other_claims_shrink_the_node() -> None:
    running = pod("r", "held", gated=False, node_name="n0")
    w = world(
        [running],
        [
            claim("held", 2, "n0", ("gpu-0", "gpu-1"), "r"),
            claim("foreign", 3, "n1", ("gpu-0", "gpu-1", "gpu-2"), "someone-else"),
        ],
    )
    (job,) = w.snapshot.jobs
    assert [(p.status, p.node, p.gpu_milli) for p in job.pods] == [("Running", "n0", 2000)]
    assert {n.name: n.gpus for n in w.snapshot.nodes} == {"n0": 8, "n1": 5}  # the foreign claim holds 3 on n1


def test_a_terminating_pod_is_releasing_until_its_claims_are_freed() -> None:
    leaving = pod("r", "held", gated=False, node_name="n0", deletionTimestamp="2027-01-15T09:00:00Z")
    w = world([leaving], [claim("held", 2, "n0", ("gpu-0", "gpu-1"), "r")])
    assert [p.status for j in w.snapshot.jobs for p in j.pods] == ["Releasing"]
    w = world([leaving], [claim("held", 2)])  # deallocated: the pod no longer counts
    assert w.snapshot.jobs == ()


def test_a_gang_whose_commit_is_under_way_counts_as_placed_and_is_no_victim() -> None:
    # pipelined cycles: the gang's commit has written one claim of two and ungated nothing yet. In flight, each
    # member counts as running where it goes, its allocated claim is its own (not another's, taken from the
    # node a second time), and the cycle neither places it again nor takes it as a victim
    pods = [pod("w0", "c0", group="train"), pod("w1", "c1", group="train")]
    claims = [claim("c0", 4, "n0", ("gpu-0", "gpu-1", "gpu-2", "gpu-3"), "w0"), claim("c1", 4)]

    def world_with(in_flight: dict[str, str] | None) -> Any:
        return world(pods, claims, [pod_group("train", 2)], in_flight=in_flight)

    before = world_with(None)  # as the informers show it: a gated gang, half its devices held by "another"
    assert [p.status for j in before.snapshot.jobs for p in j.pods] == ["Pending", "Pending"]
    assert {n.name: n.gpus for n in before.snapshot.nodes} == {"n0": 4, "n1": 8}
    flying = world_with({"team-a/w0": "n0", "team-a/w1": "n0"})
    (job,) = flying.snapshot.jobs
    assert [(p.status, p.node) for p in job.pods] == [("Running", "n0"), ("Running", "n0")]
    assert not job.preemptible
    assert {n.name: n.gpus for n in flying.snapshot.nodes} == {"n0": 8, "n1": 8}  # its claim counted once
    result = run_cycle(flying.snapshot)
    assert {d.action for d in result.pods.values()} == {"keep"} and not result.evictions


def test_a_gang_our_commit_bound_holds_its_gpus_before_the_claim_watch_shows_them() -> None:
    # the commit has allocated both claims and bound both pods, but the claim watch trails the pod watch: the
    # informers show the pods bound and ungated, their claims unallocated. Read alone that is a pod of
    # kube-scheduler's holding nothing; in flight it is ours, running where it went, its GPUs taken (a gang
    # waiting for 8 GPUs gets none of them) and counted in its queue's usage
    pods = [pod(f"w{i}", f"c{i}", group="train", gated=False, node_name=f"n{i}") for i in range(2)]
    pods.append(pod("next", "c-next", queue_name="team-b"))
    claims = [claim("c0", 8), claim("c1", 8), claim("c-next", 8)]
    queues = [queue("root"), queue("team-a", "root", 8), queue("team-b", "root", 8)]

    def world_with(in_flight: dict[str, str] | None) -> Any:
        return world(pods, claims, [pod_group("train", 2)], queues=queues, in_flight=in_flight)

    unseen = world_with(None)
    assert [j.name for j in unseen.snapshot.jobs] == ["team-a/pod/next"]
    assert run_cycle(unseen.snapshot, ["allocate"]).pods["team-a/next"].node is not None  # the GPUs look free
    landing = world_with({"team-a/w0": "n0", "team-a/w1": "n1"})
    train = next(j for j in landing.snapshot.jobs if j.name == "team-a/train")
    assert [(p.status, p.node) for p in train.pods] == [("Running", "n0"), ("Running", "n1")]
    assert not train.preemptible
    assert held(landing.snapshot)["team-a"][0] == 16 * 1000
    result = run_cycle(landing.snapshot, ["allocate"])
    assert result.pods["team-a/next"].node is None
    assert {d.action for k, d in result.pods.items() if k != "team-a/next"} == {"keep"}


@pytest.mark.parametrize(
    ("pods", "claims", "queues", "reason"),
    [
        ([pod("p", "c", queue_name="nope")], [claim("c")], None, "queue nope does not exist"),
        ([pod("p", "c", queue_name="root")], [claim("c")], None, "parent queue"),
        ([pod("p", "missing")], [], None, "not found"),
    ],
    ids=["unknown-queue", "parent-queue", "claim-missing"],
)
def test_a_gang_that_cannot_be_weighed_waits_with_a_reason(pods: Any, claims: Any, queues: Any, reason: str) -> None:
    w = world(pods, claims, queues=queues)
    assert w.snapshot.jobs == ()
    assert reason in w.waiting["team-a/pod/p"]


def test_claims_from_templates_are_waited_for() -> None:
    p = pod("p", "unused")
    p["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "one-gpu"}]
    w = world([p], [])
    assert "created from their templates" in w.waiting["team-a/pod/p"]
    p["status"] = {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "p-gpu-x1"}]}
    generated = claim("p-gpu-x1")
    w = world([p], [generated])
    assert [pp.gpu_milli for j in w.snapshot.jobs for pp in j.pods] == [1000]


def test_nodes_without_an_agent_address_or_not_ready_are_left_out() -> None:
    built = [node("n0"), node("n1"), node("n2")]
    built[1][0]["metadata"]["annotations"] = {}
    built[2][0]["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    w = world([], [], queues=[], built=built)
    assert [n.name for n in w.snapshot.nodes] == ["n0"] and w.addresses == {"n0": "n0:7000"}


def test_a_node_whose_agent_publishes_no_certificate_fingerprint_is_never_planned_onto() -> None:
    # its reservation channel cannot be pinned, so a reserve there could only fail: the gang goes elsewhere
    built = [node("bare", gpus=8), node("n1", gpus=1)]
    del built[0][0]["metadata"]["annotations"][FINGERPRINT_ANNOTATION]
    w = world([pod("p", "c")], [claim("c")], queues=[queue("team-a", gpu_quota=8)], built=built)
    assert [n.name for n in w.snapshot.nodes] == ["n1"] and w.addresses == {"n1": "n1:7000"}
    assert run_cycle(w.snapshot, ["allocate"]).pods["team-a/p"].node == "n1"


def _zoned(zones: dict[str, str], taints: dict[str, list[dict[str, str]]]) -> list[tuple[Any, Any]]:
    """Nodes with a `zone` label each and, some, taints: each object with its slice."""
    built = [node(name) for name in zones]
    for (n, _), name in zip(built, zones, strict=True):
        n["metadata"]["labels"] = {"zone": zones[name]}
        if name in taints:
            n["spec"] = {"taints": taints[name]}
    return built


DEDICATED = {"key": "dedicated", "value": "inference", "effect": "NoSchedule"}


def test_a_pod_is_placed_only_where_kube_scheduler_will_bind_it() -> None:
    # kube-scheduler binds the pod to the node the arbiter picks (its affinity narrowed to it) or not at all:
    # n0 (first by name, so the cycle's pick without the rules) is tainted, n2 is in the wrong zone
    built = _zoned({"n0": "a", "n1": "a", "n2": "b"}, {"n0": [DEDICATED]})
    p = pod("p", "c")
    p["spec"]["nodeSelector"] = {"zone": "a"}
    w = world([p], [claim("c")], queues=[queue("team-a", gpu_quota=8)], built=built)
    assert [pp.allowed_nodes for j in w.snapshot.jobs for pp in j.pods] == [frozenset({"n1"})]
    assert run_cycle(w.snapshot, ["allocate"]).pods["team-a/p"].node == "n1"
    # tolerating the taint, or its whole key, opens n0 again; required affinity counts as nodeSelector does
    for toleration in (
        {"key": "dedicated", "value": "inference", "effect": "NoSchedule"},
        {"key": "dedicated", "operator": "Exists"},
        {"operator": "Exists"},
    ):
        p["spec"]["tolerations"] = [toleration]
        w = world([p], [claim("c")], queues=[queue("team-a", gpu_quota=8)], built=built)
        assert run_cycle(w.snapshot, ["allocate"]).pods["team-a/p"].node == "n0", toleration
    del p["spec"]["nodeSelector"]
    p["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}]
            }
        }
    }
    w = world([p], [claim("c")], queues=[queue("team-a", gpu_quota=8)], built=built)
    assert run_cycle(w.snapshot, ["allocate"]).pods["team-a/p"].node == "n2"


def test_a_pod_no_node_allows_waits_in_kube_schedulers_words() -> None:
    built = _zoned({"n0": "a", "n1": "a", "n2": "b"}, {"n0": [DEDICATED]})
    p = pod("p", "c")
    p["spec"]["nodeSelector"] = {"zone": "b"}
    p["spec"]["tolerations"] = [{"key": "dedicated", "value": "training", "effect": "NoSchedule"}]  # not this one
    built[2][0]["spec"] = {"taints": [DEDICATED]}
    w = world([p], [claim("c")], queues=[queue("team-a", gpu_quota=8)], built=built)
    assert w.snapshot.jobs == ()
    assert w.waiting["team-a/pod/p"] == (
        "no node may run p: 0/3 nodes are available: 1 node(s) had untolerated taint(s), "
        "2 node(s) didn't match Pod's node affinity/selector."
    )


def test_a_gang_left_waiting_still_holds_the_devices_of_its_running_pods() -> None:
    # a running member and a new one that no node allows: the gang waits out of the snapshot, and the GPUs its
    # running member holds are still taken, not offered to the next gang
    running = pod("r", "held", group="train", gated=False, node_name="n0")
    stuck = pod("s", "wants", group="train")
    stuck["spec"]["nodeSelector"] = {"zone": "nowhere"}
    w = world(
        [running, stuck],
        [claim("held", 4, "n0", ("gpu-0", "gpu-1", "gpu-2", "gpu-3"), "r"), claim("wants", 1)],
        [pod_group("train", 1)],
    )
    assert "no node may run s" in w.waiting["team-a/train"] and w.snapshot.jobs == ()
    assert {n.name: n.gpus for n in w.snapshot.nodes} == {"n0": 4, "n1": 8}


def _container(name: str, cpu: str, **more: Any) -> dict[str, Any]:
    return {"name": name, "resources": {"requests": {"cpu": cpu, "memory": "1Gi"}}, **more}


@pytest.mark.parametrize(
    ("spec", "cpu_milli"),
    [
        ({"containers": [_container("a", "2"), _container("b", "1")]}, 3000),
        ({"initContainers": [_container("fetch", "4")], "containers": [_container("a", "3")]}, 4000),
        # a sidecar runs beside the containers and beside every init container after it
        (
            {
                "initContainers": [_container("proxy", "1", restartPolicy="Always"), _container("fetch", "4")],
                "containers": [_container("a", "3")],
            },
            5000,
        ),
        (
            {
                "initContainers": [_container("fetch", "2"), _container("proxy", "1", restartPolicy="Always")],
                "containers": [_container("a", "3")],
            },
            4000,
        ),
        ({"resources": {"requests": {"cpu": "10"}}, "containers": [_container("a", "3")]}, 10000),  # pod-level
        ({"overhead": {"cpu": "250m"}, "containers": [_container("a", "3")]}, 3250),  # its RuntimeClass's
    ],
    ids=["containers", "init-peak", "sidecar-then-init", "init-then-sidecar", "pod-level", "overhead"],
)
def test_a_pod_asks_for_what_kube_scheduler_counts(spec: dict[str, Any], cpu_milli: float) -> None:
    p = pod("p", "c")
    p["spec"].update(spec)
    w = world([p], [claim("c")])
    assert [pp.cpu_milli for j in w.snapshot.jobs for pp in j.pods] == [cpu_milli]


def test_another_pod_s_init_container_takes_its_room_on_the_node() -> None:
    # kube-scheduler counts a bound pod's largest init container against the node: n0 (64 CPUs) has 4 left
    other = {
        "metadata": {"name": "etl", "namespace": "batch", "uid": "uid-etl"},
        "spec": {
            "nodeName": "n0",
            "initContainers": [_container("unpack", "60")],
            "containers": [_container("main", "1")],
        },
        "status": {"phase": "Running"},
    }
    w = world([other, pod("p", "c")], [claim("c")])
    assert {n.name: n.cpu_milli for n in w.snapshot.nodes} == {"n0": 4000.0, "n1": 64000.0}


def test_an_admitted_pod_kube_scheduler_refuses_to_bind_is_reported_in_its_words() -> None:
    refused = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "lastTransitionTime": "2027-01-15T09:00:00Z",
        "message": "0/2 nodes are available: 1 node(s) didn't match pod anti-affinity rules, 1 node(s) "
        "didn't match Pod's node affinity/selector.",
    }
    admitted = {"annotations": {ADMITTED_ANNOTATION: "2027-01-15T08:59:59Z"}}
    stuck = pod("stuck", "c0", gated=False, **admitted)
    stuck["status"] = {"conditions": [refused]}
    gated = pod("gated", "c1", **admitted)  # kube-scheduler's "SchedulingGated" is no refusal
    gated["status"] = {"conditions": [{**refused, "reason": "SchedulingGated"}]}
    bound = pod("bound", "c2", gated=False, node_name="n1", **admitted)
    bound["status"] = {"conditions": [refused]}  # as it was before kube-scheduler bound it
    w = world(
        [stuck, gated, bound],
        [
            claim("c0", 1, "n0", ("gpu-0",), "stuck"),
            claim("c1", 1, "n0", ("gpu-1",), "gated"),
            claim("c2", 1, "n1", ("gpu-0",), "bound"),
        ],
    )
    assert list(w.unbindable) == ["team-a/stuck"]
    assert (w.unbindable["team-a/stuck"].node, w.unbindable["team-a/stuck"].message) == ("n0", refused["message"])
    assert w.unbindable["team-a/stuck"].since == parse_time("2027-01-15T09:00:00Z")


def test_a_node_over_committed_on_cpu_is_full_and_the_cycle_goes_on() -> None:
    # the arbiter's running pod and another pod ask 80 of n0's 64 CPUs (its allocatable shrank, say): n0 is full
    # and the waiting pod goes to n1, where a snapshot refused as over-full would have stopped every cycle
    running = pod("r", "held", gated=False, node_name="n0")
    running["spec"]["containers"] = [_container("main", "40")]
    other = {
        "metadata": {"name": "etl", "namespace": "batch", "uid": "uid-etl"},
        "spec": {"nodeName": "n0", "containers": [_container("main", "40")]},
        "status": {"phase": "Running"},
    }
    w = world([running, other, pod("w", "wanted")], [claim("held", 1, "n0", ("gpu-0",), "r"), claim("wanted", 1)])
    assert {n.name: n.cpu_milli for n in w.snapshot.nodes} == {"n0": 40000.0, "n1": 64000.0}
    assert run_cycle(w.snapshot).pods["team-a/w"].node == "n1"


def test_a_gang_left_waiting_still_holds_the_cpu_of_its_running_pods() -> None:
    running = pod("r", "held", group="train", gated=False, node_name="n0")
    running["spec"]["containers"] = [_container("main", "60")]
    stuck = pod("s", "wants", group="train")
    stuck["spec"]["nodeSelector"] = {"zone": "nowhere"}
    w = world([running, stuck], [claim("held", 1, "n0", ("gpu-0",), "r"), claim("wants", 1)], [pod_group("train", 1)])
    assert w.snapshot.jobs == ()
    assert {n.name: n.cpu_milli for n in w.snapshot.nodes} == {"n0": 4000.0, "n1": 64000.0}


def test_a_pod_goes_where_the_node_has_the_other_resources_it_asks_for() -> None:
    # n1 alone has the fabric (an extended resource), and room for one pod of it; n0 has room for no more pods
    built = [node("n0"), node("n1")]
    built[0][0]["status"]["allocatable"]["pods"] = "1"
    built[1][0]["status"]["allocatable"].update({"pods": "110", "example.com/ib": "1"})
    on_n0 = {
        "metadata": {"name": "dns", "namespace": "kube-system", "uid": "uid-dns"},
        "spec": {"nodeName": "n0", "containers": [_container("main", "100m")]},
        "status": {"phase": "Running"},
    }
    fabric = {"requests": {"example.com/ib": "1"}, "limits": {"example.com/ib": "1"}}
    pods = [pod(f"p{i}", f"c{i}") for i in range(3)]
    for p in pods[:2]:
        p["spec"]["containers"][0]["resources"] = fabric
    w = world([on_n0, *pods], [claim(f"c{i}") for i in range(3)], queues=[queue("team-a", gpu_quota=8)], built=built)
    assert {n.name: n.other.get("pods") for n in w.snapshot.nodes} == {"n0": 0.0, "n1": 110.0}
    decisions = run_cycle(w.snapshot, ["allocate"]).pods
    placed = sorted((name, d.node) for name, d in decisions.items())
    # one fabric pod on n1, the other has no node with the fabric left; the plain pod goes to n1 too (n0 is full)
    assert placed in (
        [("team-a/p0", "n1"), ("team-a/p1", None), ("team-a/p2", "n1")],
        [("team-a/p0", None), ("team-a/p1", "n1"), ("team-a/p2", "n1")],
    )


def test_min_runtime_comes_from_the_queue_and_counts_from_admission() -> None:
    admitted = pod("r", "held", gated=False, node_name="n0", annotations={ADMITTED_ANNOTATION: "2027-01-15T08:00:00Z"})
    queues = [
        queue("root", preemptMinRuntime="10m", reclaimMinRuntime="1h"),
        queue("team-a", "root", 8, preemptMinRuntime="5m"),
    ]
    w = world([admitted], [claim("held", 1, "n0", ("gpu-0",), "r")], queues=queues)
    root, team = w.snapshot.queues
    assert (root.preempt_min_runtime, root.reclaim_min_runtime) == (600.0, 3600.0)
    assert (team.preempt_min_runtime, team.reclaim_min_runtime) == (300.0, None)  # None: the parent's
    (job,) = w.snapshot.jobs
    assert job.started_at == parse_time("2027-01-15T08:00:00Z") and w.snapshot.now == NOW


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90.0), ("1h30m", 5400.0), ("250ms", 0.25), ("", None), ("5 minutes", None), ("10", None)],
)
def test_go_durations(text: str, seconds: float | None) -> None:
    assert parse_duration(text) == seconds


def test_a_claim_becomes_reservation_requests_and_its_allocation() -> None:
    c = claim("c", 2)
    c["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [{"cel": {"expression": "device.driver != ''"}}]
    c["spec"]["devices"]["constraints"] = [{"matchAttribute": "gpu.nvidia.com/nvlinkDomain"}]
    c["spec"]["devices"]["config"] = [{"requests": ["gpus"], "opaque": {"driver": DRIVER, "parameters": {}}}]
    r = reservation_claim(c)
    assert [(x.name, x.count, x.selectors) for x in r.requests] == [("gpus", 2, ("device.driver != ''",))]
    assert r.match_attributes == ("gpu.nvidia.com/nvlinkDomain",)
    allocation = allocation_status(c, "n1", DRIVER, {"gpus": ["gpu-2", "gpu-3"]}, {})
    assert allocation["devices"]["results"] == [
        {"request": "gpus", "driver": DRIVER, "pool": "n1", "device": "gpu-2"},
        {"request": "gpus", "driver": DRIVER, "pool": "n1", "device": "gpu-3"},
    ]
    # naming every request of the claim, the config is written as for all (empty), as kube-scheduler writes it
    assert allocation["devices"]["config"] == [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {}}}]
    assert allocation["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["n1"]


@pytest.mark.parametrize(
    "exactly",
    [
        {"deviceClassName": "tpu.example.com"},
        {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"},
        {"deviceClassName": "gpu.nvidia.com", "adminAccess": True},
    ],
    ids=["foreign-class", "all-mode", "admin-access"],
)
def test_requests_the_arbiter_does_not_handle_are_refused(exactly: dict[str, Any]) -> None:
    c = {"spec": {"devices": {"requests": [{"name": "r", "exactly": exactly}]}}}
    with pytest.raises(Unsupported):
        reservation_claim(c)


def test_queue_status_rolls_children_up_into_their_parent() -> None:
    from agent.arbiter.core.cycle import run_cycle
    from agent.arbiter.queue_status import queue_statuses

    running = pod("r", "held", gated=False, node_name="n0")
    waiting = pod("w", "wants")
    w = world([running, waiting], [claim("held", 2, "n0", ("gpu-0", "gpu-1"), "r"), claim("wants", 4)])
    status = queue_statuses(w.snapshot, run_cycle(w.snapshot))
    assert status["root"]["childQueues"] == ["team-a"] and status["team-a"]["childQueues"] == []
    assert status["team-a"]["requested"]["gpu"] == status["root"]["requested"]["gpu"] == 6
    assert status["team-a"]["allocated"]["gpu"] == 6  # the waiting pod fits: bound this cycle
    assert status["team-a"]["allocatedNonPreemptible"]["gpu"] == 0  # priority 0: preemptible
    assert status["team-a"]["fairShare"]["gpu"] == 6


@pytest.mark.parametrize(
    ("queues", "pods", "groups", "reason"),
    [
        (
            [
                queue("root"),
                queue(
                    "team-a",
                    "root",
                    8,
                ),
            ],
            [pod("p", "c24")],
            [],
            "no fit: the gang needs 24 GPUs",
        ),
        (
            [
                queue("root"),
                {
                    **queue("team-a", "root", 2),
                    "spec": {"parentQueue": "root", "resources": {"gpu": {"quota": 2, "limit": 4}}},
                },
            ],
            [pod("p", "c24")],
            [],
            "over limit: queue team-a",
        ),
        (
            [queue("root"), queue("team-a", "root", 8)],
            [pod("p", "c1", group="g")],
            [pod_group("g", 3)],
            "waiting for 2 more pod(s) of the gang (minCount 3)",
        ),
    ],
    ids=["no-fit", "over-limit", "gang-incomplete"],
)
def test_why_a_gang_waits(queues: list[Any], pods: list[Any], groups: list[Any], reason: str) -> None:
    from agent.arbiter.core.cycle import run_cycle
    from agent.arbiter.waiting import wait_reasons

    claims = [claim("c24", 24), claim("c1", 1)]
    w = world(pods, claims, groups, queues=queues)
    reasons = wait_reasons(w.snapshot, run_cycle(w.snapshot))
    assert list(reasons.values())[0].startswith(reason)


def test_a_gang_that_cannot_fit_is_told_against_the_whole_cluster() -> None:
    from agent.arbiter.core.cycle import run_cycle
    from agent.arbiter.waiting import wait_reasons

    def reason(pods: list[Any], claims: list[Any]) -> str:
        w = world(pods, claims)
        return wait_reasons(w.snapshot, run_cycle(w.snapshot))["team-a/pod/p"]

    assert reason([pod("p", "c24")], [claim("c24", 24)]) == (
        "no fit: the gang needs 24 GPUs in 1 pod(s), up to 24 on one node; the cluster has 16 GPUs on 2 node(s), "
        "at most 8 on one; 16 free, at most 8 on one: the gang asks for more than the whole cluster has"
    )
    running = [pod(f"r{i}", f"held{i}", gated=False, node_name=f"n{i}") for i in range(2)]
    held = [claim(f"held{i}", 6, f"n{i}", tuple(f"gpu-{d}" for d in range(6)), f"r{i}") for i in range(2)]
    assert reason([*running, pod("p", "c8")], [*held, claim("c8", 8)]).endswith(
        "the cluster has 16 GPUs on 2 node(s), at most 8 on one; 4 free, at most 2 on one: "
        "the rest is held by running pods"
    )
    # told against the nodes its rules allow, not the whole cluster
    picky = pod("p", "c12")
    picky["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}]
            }
        }
    }
    assert reason([picky], [claim("c12", 12)]) == (
        "no fit: the gang needs 12 GPUs in 1 pod(s), up to 12 on one node; the nodes its pods may run on have 8 GPUs "
        "on 1 node(s), at most 8 on one; 8 free, at most 8 on one: the gang asks for more than those nodes have"
    )


# -- every DRA claim counts toward its queue, once, as allocated ------------------------------------------


def test_a_claim_shared_by_several_pods_counts_once() -> None:
    # two running pods of one gang share a 2-GPU claim (KAI would count it per pod: 4)
    a = pod("a", "shared", gated=False, node_name="n0", group="g")
    b = pod("b", "shared", gated=False, node_name="n0", group="g")
    w = world([a, b], [claim("shared", 2, "n0", ("gpu-0", "gpu-1"), "a")], [pod_group("g", 2)])
    (job,) = w.snapshot.jobs
    assert sum(p.gpu_milli for p in job.pods) == 2000


def test_a_first_available_claim_counts_what_was_allocated() -> None:
    # asks for 8 GPUs or else 4; 4 were allocated: the queue holds 4, not the first choice's 8
    c = claim("flex", 1, "n0", ("gpu-0", "gpu-1", "gpu-2", "gpu-3"), "r")
    c["spec"]["devices"]["requests"] = [
        {
            "name": "gpus",
            "firstAvailable": [
                {"name": "eight", "deviceClassName": "gpu.nvidia.com", "count": 8},
                {"name": "four", "deviceClassName": "gpu.nvidia.com", "count": 4},
            ],
        }
    ]
    for r in c["status"]["allocation"]["devices"]["results"]:
        r["request"] = "gpus/four"
    w = world([pod("r", "flex", gated=False, node_name="n0")], [c])
    (job,) = w.snapshot.jobs
    assert [p.gpu_milli for p in job.pods] == [4000]


def test_a_mig_device_counts_as_its_share_of_a_gpu() -> None:
    n, s = node("n0", 1)
    s["spec"]["devices"][0].update(
        attributes={"type": {"string": "gpu"}, "uuid": {"string": "GPU-1"}}, capacity={"memory": {"value": "80Gi"}}
    )
    s["spec"]["devices"].append(
        {
            "name": "gpu-0-mig-1g10gb-19-0",
            "attributes": {"type": {"string": "mig"}, "parentUUID": {"string": "GPU-1"}},
            "capacity": {"memory": {"value": "10Gi"}},
        }
    )
    c = claim("slice", 1, "n0", ("gpu-0-mig-1g10gb-19-0",), "r")
    w = world([pod("r", "slice", gated=False, node_name="n0")], [c], built=[(n, s)])
    (job,) = w.snapshot.jobs
    assert [p.gpu_milli for p in job.pods] == [125]


# -- one allocator of the driver's devices (issue 18) ----------------------------------------------------------


def test_a_device_in_two_claims_counts_once_and_never_stops_the_cycle() -> None:
    """gpu-0 of n0 is in the running gang's claim and in a claim kube-scheduler (or a hand) wrote: the node is
    full, not over-full, so the cycle runs and places the waiting pod on n1; both claims are reported."""
    from agent.arbiter.core.cycle import run_cycle

    running = pod("r", "held", gated=False, node_name="n0")
    held = claim("held", 8, "n0", tuple(f"gpu-{i}" for i in range(8)), "r")
    foreign = claim("foreign", 1, "n0", ("gpu-0",), "someone-else")
    w = world([running, pod("w", "wanted")], [held, foreign, claim("wanted", 4)])
    assert {n.name: n.gpus for n in w.snapshot.nodes} == {"n0": 8, "n1": 8}
    assert w.doubles == {("n0", "gpu-0"): ["team-a/foreign", "team-a/held"]}
    result = run_cycle(w.snapshot)
    assert (result.pods["team-a/w"].action, result.pods["team-a/w"].node) == ("bind", "n1")


def test_two_arbiter_claims_on_one_device_leave_the_node_its_true_free_count() -> None:
    a = pod("a", "ca", gated=False, node_name="n0")
    b = pod("b", "cb", gated=False, node_name="n0")
    w = world([a, b], [claim("ca", 2, "n0", ("gpu-0", "gpu-1"), "a"), claim("cb", 1, "n0", ("gpu-1",), "b")])
    # the pods count 3 GPUs, the node holds 2 of 8: 9 "GPUs" with 3 counted leaves the 6 really free
    assert {n.name: n.gpus for n in w.snapshot.nodes}["n0"] == 9
    assert list(w.doubles) == [("n0", "gpu-1")]


def test_a_gated_pod_naming_no_queue_waits_in_the_default_queue() -> None:
    queues = [queue("root"), queue("team-a", "root", 8), queue("default")]
    w = world([pod("p", "c", queue_name=None)], [claim("c")], queues=queues)
    assert [(j.name, j.queue, [p.status for p in j.pods]) for j in w.snapshot.jobs] == [
        ("team-a/pod/p", "default", ["Pending"])
    ]


def test_an_ungated_pod_no_one_allocated_for_is_caught_by_the_arbiter() -> None:
    """Created before the fence (or ungated by hand): kube-scheduler cannot allocate our devices, so the pod
    waits in the default queue as a pending gang of one; once allocated and bound it is not the arbiter's."""
    queues = [queue("root"), queue("team-a", "root", 8), queue("default")]
    w = world([pod("p", "c", queue_name=None, gated=False)], [claim("c")], queues=queues)
    assert [(j.queue, [p.status for p in j.pods]) for j in w.snapshot.jobs] == [("default", ["Pending"])]
    bound = pod("p", "c", queue_name=None, gated=False, node_name="n0")
    w = world([bound], [claim("c", 1, "n0", ("gpu-0",), "p")], queues=queues)
    assert w.snapshot.jobs == ()
    assert {n.name: n.gpus for n in w.snapshot.nodes}["n0"] == 7


def test_a_gated_pod_whose_claims_are_not_ours_is_released() -> None:
    nic = claim("nic")
    nic["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "nic.example.com"
    gated = pod("p", "nic", queue_name=None)
    w = world([gated], [nic])
    assert w.release == [gated] and w.snapshot.jobs == () and w.waiting == {}
    w = world([pod("q", "absent", queue_name=None)], [])  # its claim is not there yet: not decided
    assert w.release == []


def test_a_pod_asking_for_the_extended_resource_waits_with_the_reason() -> None:
    queues = [queue("root"), queue("team-a", "root", 8), queue("default")]
    p = pod("p", "c", queue_name=None)
    p["spec"]["resourceClaims"] = []
    p["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "1"}
    w = world([p], [], queues=queues)
    assert "nvidia.com/gpu" in w.waiting["team-a/pod/p"]


def test_what_a_pending_claim_asks_follows_its_new_versions() -> None:
    # the GPUs a pending claim asks for are remembered per (uid, resourceVersion): tried, the same claim at a
    # new version asking for more, and one with no version at all (both read afresh)
    from agent.arbiter.world import claim_gpus

    one = claim("c", count=1)
    one["metadata"].update(uid="uid-c", resourceVersion="7")
    four = claim("c", count=4)
    four["metadata"].update(uid="uid-c", resourceVersion="8")
    assert [claim_gpus(c, DRIVER, {}) for c in (one, four, one)] == [1.0, 4.0, 1.0]
    assert claim_gpus(claim("unversioned", count=2), DRIVER, {}) == 2.0


def test_a_gang_is_told_that_nodes_publishing_gpus_serve_no_reservations() -> None:
    """Issue 33, item 7. Tried: the arbiter overlay with node agents run without --reservation-addr (no address
    on their Nodes) while they publish 16 GPUs. Before, the pod was told "the cluster has 0 GPUs on 0 node(s)"."""
    from agent.arbiter.waiting import wait_reasons

    built = [node(f"n{i}") for i in range(2)]
    for n, _ in built:
        del n["metadata"]["annotations"][ADDRESS_ANNOTATION]
    w = world([pod("p", "c1")], [claim("c1", 1)], built=built)
    reason = wait_reasons(w.snapshot, run_cycle(w.snapshot), w.unserved)["team-a/pod/p"]
    assert reason == (
        "no node the arbiter may place on: 2 node(s) with 16 GPUs serve no reservations (their "
        "node agents run without --reservation-addr, which the arbiter overlay sets; to leave the "
        "arbiter, run gpu-dra-agent arbiter --uninstall): n0, n1"
    )
    assert "0 GPUs on 0 node(s)" not in reason
    # with one node serving, the gang that does not fit is told of the other, after the cluster's numbers
    built[0][0]["metadata"]["annotations"][ADDRESS_ANNOTATION] = "n0:7000"
    w = world([pod("p", "c12")], [claim("c12", 12)], built=built)
    reason = wait_reasons(w.snapshot, run_cycle(w.snapshot), w.unserved)["team-a/pod/p"]
    assert reason.startswith("no fit: the gang needs 12 GPUs") and "8 GPUs on 1 node(s)" in reason
    assert reason.endswith(
        "; left out, 1 node(s) with 8 GPUs serve no reservations (their node agents run "
        "without --reservation-addr, which the arbiter overlay sets; to leave the arbiter, run "
        "gpu-dra-agent arbiter --uninstall): n1"
    )
