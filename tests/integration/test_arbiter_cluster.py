"""The arbiter as a running controller against the API fake, node agents serving reservations, and the stand-ins
for kube-controller-manager and kube-scheduler: gangs admitted whole or not at all, devices freed for the next
gang, reclaim across queues, and nothing lost when the arbiter is killed."""

from __future__ import annotations

import collections
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from agent.arbiter.commit import Committer, scheduled_condition
from agent.arbiter.controller import ArbiterConfig
from agent.kube.errors import ApiError
from agent.kube.rest import EVENTS, POD_GROUPS, PODS, QUEUES, RESOURCE_CLAIMS, STRATEGIC_MERGE_PATCH
from agent.names import DELETE_PROTECTION, GATE, QUEUE_LABEL
from fakes.cluster import FakeCluster, wait_for

pytestmark = pytest.mark.slow
NS = "team-a"


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(nodes=2) as c:
        c.queue("root")
        c.queue("team-a", parent="root", gpu_quota=8)
        c.queue("team-b", parent="root", gpu_quota=8)
        yield c


def gated(pod: dict[str, Any]) -> bool:
    return any(g.get("name") == GATE for g in pod["spec"].get("schedulingGates") or ())


def claims_by_pod(cluster: FakeCluster) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for c in cluster.rest.list(RESOURCE_CLAIMS)["items"]:
        for owner in c["metadata"].get("ownerReferences") or ():
            out[owner["name"]].append(c)
    return out


def allocated_devices(cluster: FakeCluster) -> list[tuple[str, str]]:
    return [
        (r["pool"], r["device"])
        for c in cluster.rest.list(RESOURCE_CLAIMS)["items"]
        for r in ((c.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", [])
    ]


def running(cluster: FakeCluster, prefix: str) -> list[dict[str, Any]]:
    return [p for p in cluster.pods() if p["metadata"]["name"].startswith(prefix) and p["spec"].get("nodeName")]


def test_a_gang_of_two_by_eight_gpus_is_admitted_on_two_nodes(cluster: FakeCluster) -> None:
    cluster.gang(NS, "train", "team-a", pods=2, gpus=8)
    cluster.arbiter()
    pods = wait_for(lambda: len(running(cluster, "train-")) == 2 and running(cluster, "train-"), what="gang bound")
    assert {p["spec"]["nodeName"] for p in pods} == {"gpu-node-0", "gpu-node-1"}
    by_pod = claims_by_pod(cluster)
    for pod in pods:
        assert not gated(pod)
        terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert terms["nodeSelectorTerms"][0]["matchFields"] == [
            {"key": "metadata.name", "operator": "In", "values": [pod["spec"]["nodeName"]]}
        ]
        (claim,) = by_pod[pod["metadata"]["name"]]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert len(results) == 8 and {r["pool"] for r in results} == {pod["spec"]["nodeName"]}
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]]
        assert DELETE_PROTECTION in claim["metadata"]["finalizers"]
    assert len(set(allocated_devices(cluster))) == 16
    status = wait_for(
        lambda: (
            ((cluster.rest.get(QUEUES, None, "team-a").get("status") or {}).get("allocated") or {}).get("gpu") == 16
            and cluster.rest.get(QUEUES, None, "team-a")["status"]
        ),
        what="queue status",
    )
    assert status["fairShare"]["gpu"] == 16 and status["requested"]["gpu"] == 16


def test_an_admitted_gang_s_podgroup_is_marked_scheduled_as_kube_scheduler_would(cluster: FakeCluster) -> None:
    """1.37's kube-scheduler writes this condition in its scheduling loop, one round trip per group, unless it
    finds it written word for word: the arbiter writes it when it admits the gang, once."""
    cluster.gang(NS, "first", "team-a", pods=2, gpus=1)
    cluster.gang(NS, "again", "team-a", pods=2, gpus=1)  # tried: marked already (admitted once, then evicted)
    earlier = {
        "type": "PodGroupInitiallyScheduled",
        "status": "True",
        "reason": "Scheduled",
        "message": "",
        "observedGeneration": cluster.rest.get(POD_GROUPS, NS, "again")["metadata"]["generation"],
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    marked = cluster.rest.patch(
        POD_GROUPS,
        NS,
        "again",
        {"status": {"conditions": [earlier]}},
        content_type=STRATEGIC_MERGE_PATCH,
        subresource="status",
    )
    cluster.arbiter()
    wait_for(
        lambda: len(running(cluster, "first-")) == 2 and len(running(cluster, "again-")) == 2, what="both gangs bound"
    )
    first = cluster.rest.get(POD_GROUPS, NS, "first")
    condition = scheduled_condition(first)
    assert condition is not None and condition.pop("lastTransitionTime")
    assert condition == {
        "type": "PodGroupInitiallyScheduled",
        "status": "True",
        "reason": "Scheduled",
        "message": "",
        "observedGeneration": first["metadata"]["generation"],
    }
    again = cluster.rest.get(POD_GROUPS, NS, "again")
    assert again["metadata"]["resourceVersion"] == marked["metadata"]["resourceVersion"]  # not written again
    assert scheduled_condition(again) == earlier


def test_a_reservation_kube_scheduler_took_back_is_given_back(cluster: FakeCluster) -> None:
    """kube-scheduler's DRA Unreserve, after a failed binding attempt, takes the pod out of the reservedFor of its
    allocated claims, ours included (seen on 1.37 when it tried a PodGroup before all its pods were ungated); the
    pods then stayed unbound with their devices allocated to no one. The next cycle gives the reservation back."""
    cluster.gang(NS, "pair", "team-a", pods=2, gpus=1)
    wait_for(lambda: all(claims_by_pod(cluster).get(f"pair-{i}") for i in range(2)), what="claims generated")
    assert cluster.controllers is not None
    cluster.controllers.binder = None  # kube-scheduler's stand-in binds nothing from here on
    arbiter = cluster.arbiter(start=False)
    wait_for(lambda: f"{NS}/pair" in arbiter.cycle().admitted, timeout=30, what="the gang admitted")
    allocations = {}
    for i in range(2):  # tried: what kube-scheduler's Unreserve writes, on both members' claims
        (claim,) = claims_by_pod(cluster)[f"pair-{i}"]
        allocations[claim["metadata"]["name"]] = claim["status"]["allocation"]
        pod = cluster.rest.get(PODS, NS, f"pair-{i}")
        assert not gated(pod) and not pod["spec"].get("nodeName")
        cluster.rest.patch(
            RESOURCE_CLAIMS,
            NS,
            claim["metadata"]["name"],
            {
                "metadata": {"uid": claim["metadata"]["uid"]},
                "status": {"reservedFor": [{"$patch": "delete", "uid": pod["metadata"]["uid"]}]},
            },
            content_type=STRATEGIC_MERGE_PATCH,
            subresource="status",
        )
    assert all(not c["status"].get("reservedFor") for cs in claims_by_pod(cluster).values() for c in cs)

    def given_back() -> bool:
        arbiter.cycle()
        return all(c["status"].get("reservedFor") for cs in claims_by_pod(cluster).values() for c in cs)

    wait_for(given_back, timeout=30, what="the reservations given back")
    for i in range(2):
        (claim,) = claims_by_pod(cluster)[f"pair-{i}"]
        pod = cluster.rest.get(PODS, NS, f"pair-{i}")
        assert [r["uid"] for r in claim["status"]["reservedFor"]] == [pod["metadata"]["uid"]]
        assert claim["status"]["allocation"] == allocations[claim["metadata"]["name"]]  # the devices kept
    assert len(set(allocated_devices(cluster))) == 2


def test_a_gang_that_cannot_fit_is_never_admitted_in_part(cluster: FakeCluster) -> None:
    cluster.gang(NS, "huge", "team-a", pods=3, gpus=8)
    wait_for(lambda: all(claims_by_pod(cluster).get(f"huge-{i}") for i in range(3)), what="claims generated")
    arbiter = cluster.arbiter(start=False)
    for _ in range(5):  # tried: five cycles with 16 GPUs for a 24-GPU gang
        report = arbiter.cycle()
        assert report.admitted == [] and report.waiting["team-a/huge"].startswith("no fit")
    assert all(gated(p) for p in cluster.pods(NS))
    assert allocated_devices(cluster) == []
    assert all(a.book.live() == [] for a in cluster.agents.values())
    assert arbiter.flush_events()
    events = cluster.rest.list(EVENTS, NS)["items"]
    assert any(e["involvedObject"]["kind"] == "PodGroup" and e["message"].startswith("no fit") for e in events)


def test_a_node_refusing_a_member_releases_the_whole_gang(cluster: FakeCluster) -> None:
    cluster.gang(NS, "train", "team-a", pods=2, gpus=8)
    agent = cluster.agents["gpu-node-1"]
    agent.book._usage = lambda: agent.usage().__class__(unhealthy=frozenset({"gpu-3"}))  # type: ignore[method-assign]
    arbiter = cluster.arbiter(start=False)
    report = wait_for(lambda: (r := arbiter.cycle()).refused and r, what="a refused commit")
    assert "does not fit" in next(iter(report.refused.values()))  # the arbiter thought 8 were free there
    assert all(a.book.live() == [] for a in cluster.agents.values())  # node 0's reservation released too
    assert allocated_devices(cluster) == [] and all(gated(p) for p in cluster.pods(NS))


def test_deleting_a_gangs_pods_frees_their_devices_for_the_next_gang(cluster: FakeCluster) -> None:
    cluster.gang(NS, "first", "team-a", pods=2, gpus=8)
    cluster.arbiter()
    wait_for(lambda: len(running(cluster, "first-")) == 2, what="first gang")
    cluster.gang(NS, "second", "team-a", pods=2, gpus=8)
    wait_for(
        lambda: any(
            e["reason"] == "Waiting"
            for e in cluster.rest.list(EVENTS, NS)["items"]
            if e["involvedObject"]["name"] == "second"
        ),
        what="second waits",
    )
    assert running(cluster, "second-") == []
    for p in running(cluster, "first-"):
        cluster.rest.delete(PODS, NS, p["metadata"]["name"])
    pods = wait_for(lambda: len(running(cluster, "second-")) == 2 and running(cluster, "second-"), what="second")
    assert {p["spec"]["nodeName"] for p in pods} == {"gpu-node-0", "gpu-node-1"}
    devices = allocated_devices(cluster)
    assert len(devices) == len(set(devices)) == 16


def test_a_burst_over_quota_is_reclaimed_when_the_other_team_arrives(
    cluster: FakeCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.arbiter.controller")
    for i in range(4):  # team-a takes all 16 GPUs: 8 in quota, 8 over it (work-conserving)
        cluster.gang(NS, f"burst{i}", "team-a", pods=1, gpus=4)
    cluster.arbiter()
    wait_for(lambda: len(running(cluster, "burst")) == 4, what="burst")
    cluster.gang("team-b", "train", "team-b", pods=2, gpus=4)
    pods = wait_for(lambda: len(running(cluster, "train-")) == 2 and running(cluster, "train-"), what="reclaim")
    assert len(pods) == 2
    assert len(running(cluster, "burst")) == 2  # team-a keeps its quota
    evicted = [e for e in cluster.rest.list(EVENTS, NS)["items"] if e["reason"] == "Evicted"]
    assert len(evicted) == 2 and all(e["type"] == "Warning" for e in evicted)
    assert {e["message"] for e in evicted} == {
        "evicted by the arbiter (reclaim) to make room for gang team-b/train of queue team-b"
    }
    assert all(
        e["involvedObject"]["kind"] == "Pod" and e["involvedObject"]["name"].startswith("burst") for e in evicted
    )
    lines = [r.getMessage() for r in caplog.records]
    assert (
        len(
            [
                m
                for m in lines
                if m.startswith("evicted team-a/burst")
                and "queue team-a" in m
                and "for gang team-b/train of queue team-b" in m
            ]
        )
        == 2
    )
    (admitted,) = [m for m in lines if m.startswith("admitted gang team-b/train")]
    assert admitted == "admitted gang team-b/train of queue team-b on nodes " + ",".join(
        sorted({p["spec"]["nodeName"] for p in pods})
    )


def test_min_runtime_spares_a_victim(cluster: FakeCluster) -> None:
    cluster.rest.patch(QUEUES, None, "team-a", {"spec": {"reclaimMinRuntime": "1h"}})
    for i in range(4):
        cluster.gang(NS, f"burst{i}", "team-a", pods=1, gpus=4)
    arbiter = cluster.arbiter()
    wait_for(lambda: len(running(cluster, "burst")) == 4, what="burst")
    cluster.gang("team-b", "train", "team-b", pods=2, gpus=4)

    def waits() -> list[dict[str, Any]]:
        return [e for e in cluster.rest.list(EVENTS, "team-b")["items"] if e["reason"] == "Waiting"]

    wait_for(lambda: any(e["type"] == "Warning" for e in waits()), what="team-b waits")
    assert arbiter.cycles > 0 and len(running(cluster, "burst")) == 4 and running(cluster, "train-") == []
    # told on the PodGroup it is about (not on each of its pods); a problem is a Warning, progress is not
    told = {
        (e["type"], e["involvedObject"]["kind"], e["involvedObject"]["name"], e["message"].split(":")[0])
        for e in waits()
    }
    assert ("Warning", "PodGroup", "train", "no fit") in told
    assert {t[:3] for t in told} <= {("Warning", "PodGroup", "train"), ("Normal", "PodGroup", "train")}


def test_an_idle_arbiter_cycles_again_only_when_a_protection_ends(cluster: FakeCluster) -> None:
    # as above, team-b waits behind victims protected for 1 h; with nothing changing, the arbiter looks every
    # 0.05 s and runs no cycle (it would decide the same); the clock passing the protection's end, with no
    # change in the cluster, starts the cycle that reclaims
    cluster.rest.patch(QUEUES, None, "team-a", {"spec": {"reclaimMinRuntime": "1h"}})
    for i in range(4):
        cluster.gang(NS, f"burst{i}", "team-a", pods=1, gpus=4)
    later = [0.0]  # seconds the arbiter's clock runs ahead
    arbiter = cluster.arbiter(ArbiterConfig(period_s=0.05, cycle_gap_s=0.1), clock=lambda: time.time() + later[0])
    wait_for(lambda: len(running(cluster, "burst")) == 4, what="burst")
    cluster.gang("team-b", "train", "team-b", pods=2, gpus=4)
    wait_for(
        lambda: any(e["reason"] == "Waiting" for e in cluster.rest.list(EVENTS, "team-b")["items"]), what="team-b waits"
    )

    def quiet_second() -> bool:  # its own last writes (Queue status) seen, a second with looks and no cycle
        cycles, looks = arbiter.cycles, arbiter.skipped_looks
        time.sleep(1.0)
        return arbiter.cycles == cycles and arbiter.skipped_looks >= looks + 10

    wait_for(quiet_second, timeout=20, what="an idle arbiter that cycles no more")
    assert running(cluster, "train-") == []
    later[0] = 3601.0
    wait_for(lambda: len(running(cluster, "train-")) == 2, what="the reclaim once the protection ended")
    assert len(running(cluster, "burst")) == 2


class _Crash(Exception):
    pass


def test_a_commit_interrupted_after_its_claims_is_finished_by_the_next_arbiter(cluster: FakeCluster) -> None:
    cluster.gang(NS, "train", "team-a", pods=2, gpus=8)
    first = cluster.arbiter(start=False)
    wait_for(lambda: all(claims_by_pod(cluster).get(f"train-{i}") for i in range(2)), what="claims generated")

    def crash(self: Committer, pod: Any, node: str, decided_at: float) -> Any:
        raise _Crash("killed between the claims and the pods")

    original = Committer.ungate
    Committer.ungate = crash  # type: ignore[method-assign]
    try:
        with pytest.raises(_Crash):
            wait_for(lambda: first.cycle().admitted, what="a commit")
    finally:
        Committer.ungate = original  # type: ignore[method-assign]
    assert all(gated(p) for p in cluster.pods(NS)) and len(allocated_devices(cluster)) == 16
    cluster.stop_arbiters()
    cluster.arbiter()  # a new leader: finds the gang committed in the API and finishes it
    pods = wait_for(lambda: len(running(cluster, "train-")) == 2 and running(cluster, "train-"), what="recovered")
    assert len({p["spec"]["nodeName"] for p in pods}) == 2 and len(set(allocated_devices(cluster))) == 16


def test_a_commit_interrupted_halfway_through_its_claims_is_rolled_back(cluster: FakeCluster) -> None:
    cluster.gang(NS, "train", "team-a", pods=2, gpus=8)
    first = cluster.arbiter(start=False)
    wait_for(lambda: all(claims_by_pod(cluster).get(f"train-{i}") for i in range(2)), what="claims generated")
    original = Committer._write_claim
    calls = []  # a gang's claims are written at once: the second call dies, the first completes

    def write_one_then_crash(self: Committer, *args: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise _Crash("killed after the first claim")
        return original(self, *args)

    Committer._write_claim = write_one_then_crash  # type: ignore[method-assign]
    try:
        with pytest.raises(_Crash):
            wait_for(lambda: first.cycle().admitted, what="a commit")
    finally:
        Committer._write_claim = original  # type: ignore[method-assign]
    assert len(allocated_devices(cluster)) == 8  # half a gang holds devices in the API: the crash left it
    cluster.stop_arbiters()
    second = cluster.arbiter(start=False)
    report = wait_for(lambda: (r := second.cycle()).recovered is not None and r, what="recovery")
    assert report.admitted == []
    wait_for(lambda: allocated_devices(cluster) == [], what="rolled back")
    wait_for(lambda: second.cycle().admitted, what="admitted afresh")
    wait_for(lambda: len(running(cluster, "train-")) == 2, what="bound")


@pytest.mark.skipif(sys.platform != "linux", reason="kill -9 of a subprocess")
def test_kill_minus_nine_of_the_arbiter_loses_nothing(cluster: FakeCluster) -> None:
    for i in range(3):
        cluster.gang(NS, f"g{i}", "team-a", pods=2, gpus=2)
    for i in range(4):
        cluster.gang(NS, f"s{i}", "team-a", pods=1, gpus=1)
    flags = ("--period", "0.1", "--cycle-gap", "0.1")
    proc = cluster.arbiter_process(*flags)
    try:
        wait_for(lambda: any(not gated(p) for p in cluster.pods(NS)), timeout=60, what="the first admission")
        os.kill(proc.pid, signal.SIGKILL)  # tried: killed while it admits the other gangs
        proc.wait(timeout=10)
        log_path = cluster.root / "restarted-arbiter.log"
        with open(log_path, "w") as log:
            proc = cluster.arbiter_process(*flags, "--log-format", "json", stderr=log)
        wait_for(
            lambda: len([p for p in cluster.pods(NS) if p["spec"].get("nodeName")]) == 10,
            timeout=60,
            what="every pod admitted after the restart",
        )
        # the first arbiter may have committed every gang before the kill landed, so the pods can all be bound
        # while the second is still starting: it is given its second from when it runs
        wait_for(lambda: "arbiter running" in log_path.read_text(), timeout=60, what="the restarted arbiter running")
        # the recovery alone may have finished every gang the first arbiter left half done; the cycle that
        # decides on the repaired state starts a cycle gap later
        time.sleep(1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    # what an operator reads after a run: cycles, and each phase's wall time beside its CPU on the cycle thread
    summary = next(r for r in map(json.loads, log_path.read_text().splitlines()) if r["msg"] == "arbiter stopped")
    assert summary["cycles"] >= 1
    assert {"snapshot", "decide", "commit"} <= summary["cpu_seconds"].keys() <= summary["seconds"].keys()
    assert all(0 <= summary["cpu_seconds"][k] <= summary["seconds"][k] + 0.05 for k in summary["cpu_seconds"])
    devices = allocated_devices(cluster)
    assert len(devices) == len(set(devices)) == 16  # 3 gangs x 2 pods x 2 GPUs + 4 x 1: every GPU, none twice
    for name, claims in claims_by_pod(cluster).items():
        pod = cluster.rest.get(PODS, NS, name)
        assert not gated(pod) and all(c["status"]["reservedFor"][0]["uid"] == pod["metadata"]["uid"] for c in claims)


def test_metrics_and_a_missing_queue_event(cluster: FakeCluster) -> None:
    cluster.pod(NS, "lost", "no-such-queue", 1)
    arbiter = cluster.arbiter(ArbiterConfig(period_s=0.2), start=False)
    from prometheus_client import CollectorRegistry

    from agent.arbiter.metrics import ArbiterMetrics

    registry = CollectorRegistry()
    arbiter.metrics = ArbiterMetrics(registry)
    report = arbiter.cycle()
    assert report.waiting[f"{NS}/pod/lost"] == "queue no-such-queue does not exist"
    assert arbiter.flush_events()
    events = [e for e in cluster.rest.list(EVENTS, NS)["items"] if e["involvedObject"]["name"] == "lost"]
    assert [e["message"] for e in events] == ["queue no-such-queue does not exist"]
    assert registry.get_sample_value("gpu_arbiter_fair_share", {"queue": "team-a", "resource": "gpu"}) == 0.0
    try:
        arbiter.cycle()
    except ApiError:  # pragma: no cover - the assertion below says what went wrong
        pytest.fail("a second cycle failed")
    assert arbiter.flush_events()
    assert len([e for e in cluster.rest.list(EVENTS, NS)["items"] if e["involvedObject"]["name"] == "lost"]) == 1


def test_a_burst_of_changes_is_decided_together_and_an_idle_arbiter_decides_at_once(cluster: FakeCluster) -> None:
    # a pod (its claim made beforehand) reaching an idle arbiter, whose last cycle started over a gap ago, is
    # decided at once, not a gap later; then pods arriving every 0.25 s for 3 s: cycles start a cycle gap (2 s)
    # apart, not one per change
    arbiter = cluster.arbiter(ArbiterConfig(period_s=30.0, cycle_gap_s=2.0), start=False)
    starts: list[float] = []
    cycle = arbiter.cycle

    def timed(**kwargs: Any) -> Any:
        starts.append(time.monotonic())
        return cycle(**kwargs)

    arbiter.cycle = timed  # type: ignore[method-assign]
    stop = threading.Event()
    loop = threading.Thread(target=arbiter.run, args=(stop,), daemon=True)
    loop.start()
    try:
        cluster.namespace(NS)
        cluster.rest.create(
            RESOURCE_CLAIMS,
            NS,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "alone-gpu", "namespace": NS},
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "gpus",
                                "exactly": {
                                    "deviceClassName": "gpu.nvidia.com",
                                    "allocationMode": "ExactCount",
                                    "count": 1,
                                },
                            }
                        ]
                    }
                },
            },
        )
        # idle: no cycle started for longer than a gap (a change pending would have started one by then)
        wait_for(
            lambda: starts and time.monotonic() - starts[-1] > 2.2, timeout=30, interval=0.1, what="an idle arbiter"
        )
        arrived = time.monotonic()
        cluster.rest.create(
            PODS,
            NS,
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "alone", "namespace": NS, "labels": {QUEUE_LABEL: "team-a"}},
                "spec": {
                    "containers": [{"name": "main", "image": "trainer:1", "resources": {"claims": [{"name": "gpus"}]}}],
                    "resourceClaims": [{"name": "gpus", "resourceClaimName": "alone-gpu"}],
                    "schedulingGates": [{"name": GATE}],
                },
            },
        )
        wait_for(lambda: not gated(cluster.rest.get(PODS, NS, "alone")), what="the pod admitted")
        assert time.monotonic() - arrived < 1.5, [round(t - arrived, 2) for t in starts]
        burst = len(starts)
        for i in range(12):  # with the pod above: 13 of the 16 GPUs
            cluster.pod(NS, f"burst-{i}", "team-a", 1)
            time.sleep(0.25)
        wait_for(lambda: len(running(cluster, "burst-")) == 12, what="the burst admitted")
    finally:
        stop.set()
        loop.join(timeout=10)
    gaps = [b - a for a, b in itertools.pairwise(starts[burst - 1 :])]
    assert gaps and min(gaps) >= 1.99, gaps
    assert len(gaps) < 8  # 12 arrivals (each a change, and more for each claim made): a handful of cycles


def test_a_queue_with_a_missing_parent_stops_no_admission_and_says_why(cluster: FakeCluster) -> None:
    # issue 17.1: this Queue made every cycle fail (KeyError) and a 1-GPU pod waited with 16 GPUs free
    cluster.queue("orphan", parent="no-such-parent", gpu_quota=4)
    cluster.pod(NS, "want", "team-a", 1)
    arbiter = cluster.arbiter(ArbiterConfig(period_s=0.2, status_period_s=0.0), start=False)
    report = wait_for(lambda: (r := arbiter.cycle()).admitted and r, what="the pod admitted")
    assert report.admitted == [f"{NS}/pod/want"]
    condition = wait_for(
        lambda: [
            c
            for c in (cluster.rest.get(QUEUES, None, "orphan").get("status") or {}).get("conditions", ())
            if c["type"] == "Valid"
        ],
        what="the Valid condition",
    )
    assert condition[0]["status"] == "False" and condition[0]["reason"] == "InvalidSpec"
    assert condition[0]["message"] == "invalid Queue: its parentQueue no-such-parent does not exist"
    healthy = cluster.rest.get(QUEUES, None, "team-a")["status"]["conditions"]
    assert [(c["type"], c["status"]) for c in healthy] == [("Valid", "True")]
    assert arbiter.flush_events()
    (event,) = [e for e in cluster.rest.list(EVENTS, "default")["items"] if e["involvedObject"]["name"] == "orphan"]
    assert (event["type"], event["reason"], event["involvedObject"]["kind"]) == ("Warning", "Invalid", "Queue")
    arbiter.cycle()  # told once, not once a cycle
    assert arbiter.flush_events()
    assert (
        len([e for e in cluster.rest.list(EVENTS, "default")["items"] if e["involvedObject"]["name"] == "orphan"]) == 1
    )


@pytest.mark.skipif(sys.platform != "linux", reason="kill -9 of a subprocess")
def test_with_leader_election_one_arbiter_decides_and_a_standby_takes_over(cluster: FakeCluster) -> None:
    from agent.kube.rest import LEASES

    flags = ("--period", "0.1", "--leader-elect", "--leader-elect-namespace", "default")
    procs = [cluster.arbiter_process(*flags) for _ in range(2)]
    try:
        cluster.gang(NS, "first", "team-a", pods=1, gpus=8)
        wait_for(lambda: running(cluster, "first-"), timeout=90, what="the leader admits")
        holder = cluster.rest.get(LEASES, "default", "gpu-dra-arbiter")["spec"]["holderIdentity"]
        assert holder
        leader = procs[0] if _leads(procs[0], holder) else procs[1]
        os.kill(leader.pid, signal.SIGKILL)  # tried: the leader dies without giving the Lease back
        leader.wait(timeout=10)
        cluster.gang(NS, "second", "team-a", pods=1, gpus=8)
        wait_for(lambda: running(cluster, "second-"), timeout=90, what="the standby takes over and admits")
        lease = cluster.rest.get(LEASES, "default", "gpu-dra-arbiter")["spec"]
        assert lease["holderIdentity"] != holder and lease["leaseTransitions"] >= 1
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(timeout=20)


def _leads(proc: subprocess.Popen[bytes], holder: str) -> bool:
    """Whether `proc` holds the Lease: an arbiter's identity is `<hostname>_<pid>_<random>`."""
    return f"_{proc.pid}_" in holder


def test_time_aware_usage_is_kept_in_the_queue_status_and_survives_a_restart(cluster: FakeCluster) -> None:
    # team-a holds all 16 GPUs for an hour; its decayed usage goes into its Queue's status, and a new arbiter
    # (a restart, or a new leader) resumes from it instead of starting from nothing
    cluster.gang(NS, "train", "team-a", pods=2, gpus=8)
    now = [1_900_000_000.0]
    config = ArbiterConfig(period_s=0.2, usage_half_life_s=3600.0)
    first = cluster.arbiter(config, start=False, clock=lambda: now[0])
    wait_for(lambda: first.cycle() and len(running(cluster, "train-")) == 2, what="gang running")
    now[0] += 3600
    first.cycle()
    # all of the cluster's GPUs for the whole hour (Queue status is written in the background, in order)
    wait_for(
        lambda: ((cluster.rest.get(QUEUES, None, "team-a").get("status") or {}).get("usage") or {}).get("gpu", 0) > 0.9,
        what="an hour's usage in the queue status",
    )
    state = cluster.rest.get(QUEUES, None, "team-a")["status"]["usageState"]
    assert state["possible"]["gpu"] > 0 and state["updatedAt"]
    cluster.stop_arbiters()

    now[0] += 10
    second = cluster.arbiter(config, start=False, clock=lambda: now[0])
    report = second.cycle()
    assert report.result is not None
    assert report.result.usage["team-a"][0] > 0.9  # resumed, not a fresh start
    assert report.result.usage.get("team-b", (0.0,))[0] == 0.0
