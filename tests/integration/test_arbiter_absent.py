"""Issue 33, item 1: while no arbiter runs, the pods that wait for it are told so, by one node agent; and
`gpu-dra-agent arbiter --uninstall` hands them to kube-scheduler, so that switching from the arbiter overlay to
another leaves neither the fence nor the gate behind (checked with kubectl, as an operator runs it)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fakes.apiserver
from agent.absent_arbiter import ABSENCE_LEASE, REASON, AbsenceTeller, arbiter_absence
from agent.kube.errors import Conflict, NotFound
from agent.kube.events import EventRecorder
from agent.kube.rest import DEVICE_TAINT_RULES, EVENTS, LEASES, PODS, RESOURCE_CLAIMS, Resource, Rest
from agent.names import COMPONENT, FENCE_RULE, GATE
from tests.integration.conftest import Cluster, kubectl, needs_kubectl

NS = "gpu-dra-agent"
DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"
NOW = 1_800_000_000.0
NAMESPACES = Resource("", "v1", "namespaces", False)


def stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(t))


def lease(holder: str, renewed: float) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": COMPONENT, "namespace": NS},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "renewTime": stamp(renewed)},
    }


def fence() -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": FENCE_RULE},
        "spec": {"deviceSelector": {"driver": "gpu.nvidia.com"}, "taint": {"key": FENCE_RULE, "effect": "NoSchedule"}},
    }


def claim(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }


def pod(name: str, claim_name: str | None = None, *, gated: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox"}]}
    if claim_name:
        spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim_name}]
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"}, "spec": spec}


@pytest.fixture
def rest() -> Iterator[Rest]:
    with fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        for name in (NS, "default"):
            with contextlib.suppress(Conflict):  # the fake may create `default` itself
                rest.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        yield rest


def told(rest: Rest) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for e in rest.list(EVENTS, "default")["items"]:
        if e["reason"] == REASON:
            out.setdefault(e["involvedObject"]["name"], []).append(e)
    return out


def test_the_lease_says_whether_and_since_when_no_arbiter_runs() -> None:
    where = f"{NS}/{COMPONENT}"
    assert arbiter_absence(lease("arbiter-1", NOW - 3), NOW, where) is None
    assert arbiter_absence(lease("arbiter-1", NOW - 600), NOW, where) == (
        f"no arbiter has renewed its Lease {where} since {stamp(NOW - 600)[:19]}Z (last held by arbiter-1)"
    )
    assert "gave up its Lease" in str(arbiter_absence(lease("", NOW - 3), NOW, where))
    assert "does not exist" in str(arbiter_absence(None, NOW, where))


def test_one_node_agent_tells_each_pod_that_waits_for_an_absent_arbiter_once(rest: Rest) -> None:
    """Tried: the arbiter stopped ten minutes ago; its fence and gate stayed. A gated pod, and an ungated pod
    whose claim of our class nobody allocated (behind the fence), waited in silence. Three node agents look."""
    rest.create(LEASES, NS, lease("arbiter-1", NOW - 600))
    rest.create(DEVICE_TAINT_RULES, None, fence())
    rest.create(RESOURCE_CLAIMS, "default", claim("c1"))
    rest.create(PODS, "default", pod("gated", gated=True))
    rest.create(PODS, "default", pod("fenced", "c1"))
    rest.create(PODS, "default", pod("cpu-only"))  # waits for nothing of ours: not told
    recorders = [EventRecorder(rest, "gpu-dra-agent", node) for node in ("gpu-b", "gpu-a", "gpu-c")]
    tellers = [
        AbsenceTeller(rest, NS, node, r, clock=lambda: NOW)
        for node, r in zip(("gpu-b", "gpu-a", "gpu-c"), recorders, strict=True)
    ]
    assert [t.check() for t in tellers] == [2, 0, 0]  # one writer: the first to take the Lease of their own
    assert rest.get(LEASES, NS, ABSENCE_LEASE)["spec"]["holderIdentity"] == "gpu-b"
    for r in recorders:
        r.flush()
    events = told(rest)
    assert sorted(events) == ["fenced", "gated"]
    (gated,) = events["gated"]
    assert gated["type"] == "Warning" and gated["count"] == 1
    assert gated["message"].startswith(
        f"waiting for the gpu-dra-agent queue arbiter: no arbiter has renewed its Lease {NS}/{COMPONENT} since "
        f"{stamp(NOW - 600)[:19]}Z (last held by arbiter-1); it carries the scheduling gate {GATE}"
    )
    assert "gpu-dra-agent arbiter --uninstall" in gated["message"]
    assert FENCE_RULE in events["fenced"][0]["message"]
    # told once: the next periods write nothing while nothing changed
    assert [t.check() for t in tellers] == [0, 0, 0]
    # an arbiter renews its Lease again: nothing is told, and nothing is asked beyond the Lease
    renewed = rest.get(LEASES, NS, COMPONENT)
    renewed["spec"] = lease("arbiter-2", NOW - 1)["spec"]
    rest.replace(LEASES, renewed)
    assert [t.check() for t in tellers] == [0, 0, 0]


def test_nothing_is_told_where_the_arbiter_is_not_installed(rest: Rest) -> None:
    rest.create(PODS, "default", pod("gated", gated=True))  # a gate of someone else's making; no Lease, no fence
    recorder = EventRecorder(rest, "gpu-dra-agent", "gpu-a")
    assert AbsenceTeller(rest, NS, "gpu-a", recorder, clock=lambda: NOW).check() == 0
    with pytest.raises(NotFound):
        rest.get(LEASES, NS, ABSENCE_LEASE)  # no agent campaigns where there is no arbiter


def gates(cluster: Cluster, name: str) -> list[str]:
    got = cluster.raw("GET", f"/api/v1/namespaces/default/pods/{name}").body
    return [g["name"] for g in got["spec"].get("schedulingGates") or ()]


@needs_kubectl
def test_uninstall_hands_waiting_pods_to_kube_scheduler_and_the_next_overlay_has_no_fence(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Tried, as an operator: `kubectl apply -k daemonset/overlays/arbiter`, a pod with a claim (gated by the
    overlay's policy), then the switch to another overlay. Before, the fence and the gate stayed, and the pod
    waited for good: nothing removed them."""
    listed = cluster.raw("GET", "/apis/admissionregistration.k8s.io/v1").body
    if not any(r.get("name") == "mutatingadmissionpolicies" for r in listed.get("resources") or []):
        pytest.skip("the arbiter overlay's MutatingAdmissionPolicy v1 is served from Kubernetes 1.36")
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    rule = f"/apis/resource.k8s.io/v1/devicetaintrules/{FENCE_RULE}"
    try:
        done = kubectl(config, "apply", "-k", str(DAEMONSET / "overlays" / "arbiter"))
        assert done.returncode == 0, done.stderr
        assert cluster.raw("GET", rule).status == 200
        assert (
            cluster.raw("POST", "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims", claim("c1")).status == 201
        )
        deadline = time.monotonic() + 30  # the policy applies a moment after it is created
        while True:
            cluster.raw("DELETE", "/api/v1/namespaces/default/pods/waits?gracePeriodSeconds=0")
            while cluster.raw("GET", "/api/v1/namespaces/default/pods/waits").status == 200:
                time.sleep(0.1)
            assert cluster.raw("POST", "/api/v1/namespaces/default/pods", pod("waits", "c1")).status == 201
            if GATE in gates(cluster, "waits"):
                break
            assert time.monotonic() < deadline, "the overlay's admission policy never gated the pod"
            time.sleep(0.5)
        out = subprocess.run(
            [sys.executable, "-m", "agent.cli", "arbiter", "--uninstall", "--kubeconfig", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr
        assert f"deleted Deployment {NS}/gpu-dra-agent-arbiter" in out.stdout
        assert f"deleted DeviceTaintRule {FENCE_RULE}" in out.stdout
        assert "ungated pod default/waits" in out.stdout
        assert gates(cluster, "waits") == []  # kube-scheduler takes it
        assert cluster.raw("GET", rule).status == 404
        for kind in ("mutatingadmissionpolicies", "mutatingadmissionpolicybindings"):
            for name in ("gpu-dra-agent-arbiter-gate", "gpu-dra-agent-claim-protection"):
                path = f"/apis/admissionregistration.k8s.io/v1/{kind}/{name}"
                assert cluster.raw("GET", path).status == 404
        # the switch: another overlay applied, no fence, and a new pod with a claim is not gated
        done = kubectl(config, "apply", "-k", str(DAEMONSET / "overlays" / "consumable-shares"))
        assert done.returncode == 0, done.stderr
        assert cluster.raw("GET", rule).status == 404
        time.sleep(2)  # kube-apiserver's policy informer has seen the deletion
        assert cluster.raw("POST", "/api/v1/namespaces/default/pods", pod("after", "c1")).status == 201
        assert gates(cluster, "after") == []
        # run again: nothing left to remove, and it says so without failing
        again = subprocess.run(
            [sys.executable, "-m", "agent.cli", "arbiter", "--uninstall", "--kubeconfig", str(config)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert again.returncode == 0, again.stderr
        assert "0 pod(s) handed to kube-scheduler" in again.stdout
    finally:  # the real control plane is shared: nothing of the overlay may reach the next test
        kubectl(config, "delete", "-k", str(DAEMONSET / "overlays" / "arbiter"), "--ignore-not-found", "--wait=false")
        cluster.raw("DELETE", rule)
