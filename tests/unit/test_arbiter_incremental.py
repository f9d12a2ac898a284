"""The incremental snapshot (issue 37): a snapshot built with the WorldCache of earlier ones is the snapshot
built from scratch, and so are the cycle's decisions, over random sequences of what informers see.

What changes here as the informers would change it: an object that changes is a new object with a new
resourceVersion, the others stay the same objects, in the informer's order (a changed object keeps its place, a
new one comes last). Covered: pods added, gated, ungated, bound, terminating, deleted, and deleted and made again
under their name (last in the order now); claims made, allocated (on a node, by devices) and freed while their
pods stay as they were; a claim shared by pods of two gangs; a firstAvailable claim; PodGroups made, changed and
deleted; a Queue's quota; a node's slice republished; a node cordoned and uncordoned; gangs whose commit is under
way (in_flight); claims a node refused as written; the clock; MIG devices, each worth a fraction of a GPU, whose
milli-GPUs round against their queue's running sum. Not covered: consumable-capacity shares (the cache weighs a
gang holding one afresh every time, as it does a firstAvailable claim)."""

from __future__ import annotations

import copy
import itertools
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.core.snapshot import SnapshotError
from agent.arbiter.world import World, WorldCache, build_world
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION, GATE, QUEUE_LABEL

DRIVER = "gpu.nvidia.com"
NOW = 1_800_000_000.0
NODES = ("n0", "n1")
_versions = itertools.count(1)


def _new(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as the informer holds it after a change: a new object, a new resourceVersion."""
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = str(next(_versions))
    return out


def _queue(name: str, parent: str | None, quota: float) -> dict[str, Any]:
    spec: dict[str, Any] = {"resources": {"gpu": {"quota": quota, "limit": -1, "overQuotaWeight": 1}}}
    if parent:
        spec["parentQueue"] = parent
    return _new({"metadata": {"name": name, "uid": f"q-{name}"}, "spec": spec})


def _node(name: str) -> dict[str, Any]:
    return _new(
        {
            "metadata": {
                "name": name,
                "uid": f"n-{name}",
                "annotations": {ADDRESS_ANNOTATION: f"{name}:7000", FINGERPRINT_ANNOTATION: "ab" * 32},
            },
            "status": {"allocatable": {"cpu": "64", "memory": "512Gi"}},
        }
    )


def _slice(name: str, generation: int, gpus: int, migs: int = 0) -> dict[str, Any]:
    """`migs`: MIG devices of 20 GB beside the GPUs, on a 70 GB GPU of their own (each worth 2/7 of a GPU)."""
    devices: list[dict[str, Any]] = [
        {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(gpus)
    ]
    if migs:
        devices.append(
            {
                "name": "gpu-parent",
                "attributes": {"type": {"string": "gpu"}, "uuid": {"string": f"GPU-{name}"}},
                "capacity": {"memory": {"value": "70G"}},
            }
        )
        devices += [
            {
                "name": f"mig-{i}",
                "attributes": {"type": {"string": "mig"}, "parentUUID": {"string": f"GPU-{name}"}},
                "capacity": {"memory": {"value": "20G"}},
            }
            for i in range(migs)
        ]
    return _new(
        {
            "metadata": {"name": f"{name}-gpu", "uid": f"s-{name}"},
            "spec": {
                "driver": DRIVER,
                "nodeName": name,
                "pool": {"name": name, "generation": generation, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
    )


def _claim(name: str, count: int, first_available: bool, mig: bool = False) -> dict[str, Any]:
    request: dict[str, Any] = {
        "name": "gpus",
        "exactly": {"deviceClassName": "mig.nvidia.com" if mig else "gpu.nvidia.com", "count": count},
    }
    if first_available:
        request = {
            "name": "gpus",
            "firstAvailable": [
                {"name": "big", "deviceClassName": "gpu.nvidia.com", "count": count + 2},
                {"name": "small", "deviceClassName": "gpu.nvidia.com", "count": count},
            ],
        }
    return _new(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": f"c-{name}"},
            "spec": {"devices": {"requests": [request]}},
        }
    )


def _pod(name: str, claim: str, group: str | None, queue: str) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"requests": {"cpu": "2", "memory": "8Gi"}}}],
        "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        "schedulingGates": [{"name": GATE}],
    }
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    return _new(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"p-{name}",
                "labels": {QUEUE_LABEL: queue},
                "creationTimestamp": "2027-01-15T08:00:00Z",
            },
            "spec": spec,
        }
    )


def _group(name: str, min_count: int, priority: int) -> dict[str, Any]:
    return _new(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"g-{name}",
                "creationTimestamp": "2027-01-15T07:00:00Z",
            },
            "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}, "priority": priority},
        }
    )


class Cluster:
    """What the informers hold, changed one event at a time."""

    def __init__(self) -> None:
        self.queues = {n: _queue(n, p, q) for n, p, q in (("root", None, 0), ("a", "root", 4), ("b", "root", 4))}
        self.nodes = {n: _node(n) for n in NODES}
        self.slices = {n: _slice(n, 1, 4, migs=3) for n in NODES}
        self.pods: dict[str, dict[str, Any]] = {}
        self.claims: dict[str, dict[str, Any]] = {}
        self.groups: dict[str, dict[str, Any]] = {}
        self.now = NOW
        self.free = {n: [f"gpu-{i}" for i in range(4)] for n in NODES}
        self.free_migs = {n: [f"mig-{i}" for i in range(3)] for n in NODES}

    def apply(self, event: tuple[Any, ...]) -> None:  # noqa: C901, PLR0912 - one branch per kind of event
        kind, i, j = event
        pods = sorted(self.pods)
        if kind == "add":
            name = f"p{len(self.pods) + i * 100}"
            if name in self.pods:
                return
            shared = i % 4 == 3 and pods  # the claim of another pod (of another gang, or of none)
            claim = (
                self.pods[pods[j % len(pods)]]["spec"]["resourceClaims"][0]["resourceClaimName"]
                if shared
                else f"{name}-gpu"
            )
            if not shared:
                self.claims[claim] = _claim(claim, 1 + j % 2, first_available=j % 5 == 4, mig=j % 6 == 5)
            group = f"g{j % 3}" if j % 4 else None
            self.pods[name] = _pod(name, claim, group, "a" if i % 2 else "b")
        elif kind == "group" and (i % 4 or not self.groups):
            self.groups[f"g{j % 3}"] = _group(f"g{j % 3}", 1 + i % 2, 100 * (j % 2))
        elif kind == "group":
            self.groups.pop(sorted(self.groups)[j % len(self.groups)], None)
        elif not pods:
            return
        elif kind == "alloc":  # the claim allocated on a node (the commit's first writes): the pod unchanged
            name = pods[j % len(pods)]
            pod = self.pods[name]
            claim_name = pod["spec"]["resourceClaims"][0]["resourceClaimName"]
            claim = self.claims.get(claim_name)
            node = NODES[i % 2]
            mig = claim is not None and "mig" in str(claim["spec"]["devices"]["requests"][0])
            free = self.free_migs[node] if mig else self.free[node]
            if claim is None or claim.get("status") or not free:
                return
            claim = _new(claim)
            claim["status"] = {
                "allocation": {
                    "devices": {"results": [{"request": "gpus", "driver": DRIVER, "pool": node, "device": free.pop()}]},
                    "nodeSelector": {
                        "nodeSelectorTerms": [
                            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                        ]
                    },
                },
                "reservedFor": [{"resource": "pods", "name": name, "uid": pod["metadata"]["uid"]}],
            }
            self.claims[claim_name] = claim
        elif kind in ("ungate", "free"):
            name = pods[j % len(pods)]
            pod = self.pods[name]
            claim_name = pod["spec"]["resourceClaims"][0]["resourceClaimName"]
            claim = self.claims.get(claim_name)
            if claim is None or not claim.get("status"):
                return
            if kind == "free":  # rolled back, or freed by its owner: the pod unchanged
                self._give_back(claim)
                self.claims[claim_name] = _new({k: v for k, v in claim.items() if k != "status"})
                return
            pod = _new(pod)  # ungated, and bound by kube-scheduler (or not yet)
            pod["spec"].pop("schedulingGates", None)
            if i % 3:
                pod["spec"]["nodeName"] = claim["status"]["allocation"]["devices"]["results"][0]["pool"]
            self.pods[name] = pod
        elif kind == "readd":  # deleted and made again under its name: the informer's store has it last now
            name = pods[j % len(pods)]
            self.pods[name] = _new(self.pods.pop(name))
        elif kind == "touch":  # a change the snapshot does not read: a new object all the same
            name = pods[j % len(pods)]
            pod = _new(self.pods[name])
            pod["metadata"].setdefault("annotations", {})["seen"] = str(i)
            self.pods[name] = pod
        elif kind == "end":  # terminating, then gone with its claim freed
            name = pods[j % len(pods)]
            pod = self.pods[name]
            if pod["metadata"].get("deletionTimestamp") or i % 2:
                del self.pods[name]
                claim_name = pod["spec"]["resourceClaims"][0]["resourceClaimName"]
                claim = self.claims.get(claim_name)
                if claim is not None and claim.get("status"):
                    self._give_back(claim)
                    self.claims[claim_name] = _new({k: v for k, v in claim.items() if k != "status"})
            else:
                pod = _new(pod)
                pod["metadata"]["deletionTimestamp"] = "2027-01-15T09:00:00Z"
                self.pods[name] = pod
        elif kind == "queue":
            name = "a" if i % 2 else "b"
            self.queues[name] = _queue(name, "root", j % 6)
        elif kind == "slice":  # republished: a new generation, maybe a GPU more or less
            node = NODES[i % 2]
            generation = int(self.slices[node]["spec"]["pool"]["generation"]) + 1
            self.slices[node] = _slice(node, generation, 4 + j % 2, migs=3)
        elif kind == "node":  # cordoned, or uncordoned: served or not
            node = NODES[i % 2]
            changed = _new(self.nodes[node])
            changed["spec"] = {"unschedulable": not (self.nodes[node].get("spec") or {}).get("unschedulable")}
            self.nodes[node] = changed
        elif kind == "clock":
            self.now += 1 + j

    def _give_back(self, claim: dict[str, Any]) -> None:
        for r in claim["status"]["allocation"]["devices"]["results"]:
            free = self.free_migs if r["device"].startswith("mig-") else self.free
            free[r["pool"]].append(r["device"])

    def build(
        self,
        cache: WorldCache | None,
        weighed: dict[str, float],
        in_flight: dict[str, str],
        refused: dict[str, str] | None = None,
    ) -> World:
        return build_world(
            pods=list(self.pods.values()),
            claims=list(self.claims.values()),
            pod_groups=list(self.groups.values()),
            queues=list(self.queues.values()),
            nodes=list(self.nodes.values()),
            slices=list(self.slices.values()),
            driver=DRIVER,
            now=self.now,
            in_flight=in_flight,
            weighed=weighed,
            refused_claims=refused,
            cache=cache,
        )


def _same(fresh: World, cached: World) -> None:
    assert cached.snapshot == fresh.snapshot
    assert cached.waiting == fresh.waiting and cached.weighed == fresh.weighed
    assert sorted(cached.invalid) == sorted(fresh.invalid) and cached.release == fresh.release
    assert cached.doubles == fresh.doubles and cached.unserved == fresh.unserved
    assert cached.stranded == fresh.stranded and cached.addresses == fresh.addresses
    assert {k: (m.node, m.choices, m.claims) for k, m in cached.members.items()} == {
        k: (m.node, m.choices, m.claims) for k, m in fresh.members.items()
    }
    try:  # the generated in_flight placements may overfill a node: then both refuse alike
        decided = run_cycle(fresh.snapshot).pods
    except SnapshotError as e:
        with pytest.raises(SnapshotError, match=re.escape(str(e))):
            run_cycle(cached.snapshot)
        return
    assert run_cycle(cached.snapshot).pods == decided


EVENTS = st.tuples(
    st.sampled_from(
        [
            "add",
            "add",
            "add",
            "alloc",
            "alloc",
            "ungate",
            "ungate",
            "free",
            "touch",
            "readd",
            "end",
            "group",
            "group",
            "queue",
            "slice",
            "node",
            "clock",
        ]
    ),
    st.integers(0, 11),
    st.integers(0, 41),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(EVENTS, st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=40))
def test_a_snapshot_built_incrementally_is_the_one_built_from_scratch(steps: list[tuple[Any, int, int]]) -> None:
    cluster, cache = Cluster(), WorldCache()
    weighed: dict[str, float] = {}
    for event, flying, refusals in steps:
        cluster.apply(event)
        # a few pending pods whose gang's commit is under way, as the controller passes them, and a few whose
        # claim a node refused as written
        gated = [k for k, p in sorted(cluster.pods.items()) if p["spec"].get("schedulingGates")]
        in_flight = {f"ns/{k}": NODES[n % 2] for n, k in enumerate(gated[:flying])}
        refused = {
            f"ns/{cluster.pods[k]['spec']['resourceClaims'][0]['resourceClaimName']}": "refused as written"
            for k in gated[len(gated) - refusals :]
        }
        fresh = cluster.build(None, weighed, in_flight, refused)
        cached = cluster.build(cache, weighed, in_flight, refused)
        _same(fresh, cached)
        weighed = fresh.weighed


def test_an_unchanged_cluster_is_read_and_weighed_once() -> None:
    cluster, cache = Cluster(), WorldCache()
    for j in (0, 8, 12, 16, 28, 32, 36, 40, 52):
        cluster.apply(("add", 1, j))  # pods alone, of whole GPUs, no firstAvailable, no claim shared
    first = cluster.build(cache, {}, {})
    assert cache.pods_read == len(cluster.pods)
    assert cache.jobs_weighed == len(first.snapshot.jobs) == 9
    # a gang first seen waiting is first seen `now`: remembered from the next snapshot on
    second = cluster.build(cache, first.weighed, {})
    assert (cache.pods_read, cache.jobs_weighed) == (0, 9)
    third = cluster.build(cache, second.weighed, {})
    assert (cache.pods_read, cache.jobs_weighed) == (0, 0)
    cluster.apply(("touch", 0, 0))  # one pod changes: that pod is read again, and its gang weighed
    fourth = cluster.build(cache, third.weighed, {})
    assert (cache.pods_read, cache.jobs_weighed) == (1, 1)
    _same(cluster.build(None, third.weighed, {}), fourth)


def test_a_pod_groups_change_alone_is_seen() -> None:
    """Its pods unchanged, a new PodGroup (another priority) weighs its gang again."""
    cluster, cache = Cluster(), WorldCache()
    cluster.apply(("group", 1, 1))  # g1: minCount 2, priority 100
    cluster.apply(("add", 1, 1))
    cluster.apply(("add", 1, 1))
    weighed: dict[str, float] = {}
    for _ in range(3):  # until the gang is remembered
        _same(cluster.build(None, weighed, {}), cluster.build(cache, weighed, {}))
        weighed = cluster.build(None, weighed, {}).weighed
    assert cache.jobs_weighed == 0
    cluster.apply(("group", 1, 4))  # g1: priority 0
    fresh = cluster.build(None, weighed, {})
    assert [j.priority for j in fresh.snapshot.jobs] == [0]
    _same(fresh, cluster.build(cache, weighed, {}))


def test_a_running_gang_unchanged_is_weighed_again_when_its_node_is_no_longer_served() -> None:
    """A gang whose objects did not change is kept whole by the grouping, and its weighing too; but whether its
    running pod's node is served is read from the nodes, not from its objects: cordoned, the pod is no longer
    counted in its job (its devices are not the arbiter's to count), as from scratch."""
    cluster, cache = Cluster(), WorldCache()
    cluster.apply(("add", 1, 0))  # p100: a gang of one, one GPU
    cluster.apply(("alloc", 0, 0))  # allocated on NODES[0]
    cluster.apply(("ungate", 1, 0))  # ungated and bound there: running
    weighed: dict[str, float] = {}
    for _ in range(3):  # until the gang is remembered
        _same(cluster.build(None, weighed, {}), cluster.build(cache, weighed, {}))
        weighed = cluster.build(None, weighed, {}).weighed
    assert cache.jobs_weighed == 0
    assert [p.status for j in cluster.build(None, weighed, {}).snapshot.jobs for p in j.pods] == ["Running"]
    cluster.apply(("node", 0, 0))  # NODES[0] cordoned
    fresh = cluster.build(None, weighed, {})
    assert fresh.snapshot.jobs == ()
    _same(fresh, cluster.build(cache, weighed, {}))
