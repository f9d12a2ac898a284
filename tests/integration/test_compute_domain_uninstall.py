"""`gpu-dra-agent compute-domain-controller --uninstall`, the chart's pre-delete hook: the controller is stopped
before its RBAC goes, so its Lease is free for the next install, and no ComputeDomain or template is left with a
finalizer nothing will remove (the CRD's deletion would wait on them for ever). On the API fake, the controller
in a process of its own, as deployed."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import fakes.apiserver
from agent.computedomain.controller import COMPONENT
from agent.computedomain.model import FINALIZER
from agent.computedomain.uninstall import COMPUTE_DOMAIN_CONTROLLER, DEPLOYMENT
from agent.kube.errors import Conflict, NotFound
from agent.kube.rest import COMPUTE_DOMAINS, LEASES, RESOURCE_CLAIM_TEMPLATES, Resource, Rest
from agent.kube.uninstall import DEPLOYMENTS, StillRunning, uninstall
from fakes.cluster import CRDS, _served, wait_for

NS, WORK = "gpu-dra-agent", "mnnvl"
CRD = Path(__file__).resolve().parents[2] / "daemonset" / "overlays" / "compute-domains" / "computedomain-crd.yaml"
NAMESPACES = Resource("", "v1", "namespaces", False)


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        for name in (NS, WORK):
            with contextlib.suppress(Conflict):
                rest.create(NAMESPACES, None, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        for crd in yaml.safe_load_all(CRD.read_text()):
            rest.create(CRDS, None, crd)
        wait_for(lambda: _served(rest, COMPUTE_DOMAINS), timeout=30, what="the ComputeDomain CRD")
        rest.create(DEPLOYMENTS, NS, _deployment())
        yield server


def _deployment() -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "gpu-dra-agent", "app.kubernetes.io/component": "compute-domains"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": DEPLOYMENT, "namespace": NS, "labels": labels},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "controller", "image": "gpu-dra-agent:dev"}]},
            },
        },
    }


def _domain(name: str, template: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name, "namespace": WORK},
        "spec": {"numNodes": 2, "channel": {"resourceClaimTemplate": {"name": template}}},
    }


def _finalizers(rest: Rest, resource: Resource, name: str) -> list[str]:
    try:
        return list(rest.get(resource, WORK, name)["metadata"].get("finalizers") or [])
    except NotFound:
        return []


def _cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", "compute-domain-controller", "--kubeconfig", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_uninstall_stops_the_controller_frees_its_lease_and_leaves_no_finalizer(
    server: fakes.apiserver.ApiServer, tmp_path: Path
) -> None:
    """Tried, as `helm uninstall` does it: the controller running and leading, a ComputeDomain with its template
    (both carrying the controller's finalizer), then the hook. A stand-in for the Deployment's pods stops the
    controller (SIGTERM) once the Deployment is deleted. Before the hook, helm deleted the controller with its
    RBAC at once: the Lease stayed held for 15 s and the domain's finalizer for good."""
    rest = server.rest()
    config = server.write_kubeconfig(tmp_path / "kubeconfig")
    controller = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "compute-domain-controller", "--kubeconfig", str(config), "--period", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        rest.create(COMPUTE_DOMAINS, WORK, _domain("train", "train-channel"))
        wait_for(
            lambda: (
                FINALIZER in _finalizers(rest, COMPUTE_DOMAINS, "train")
                and FINALIZER in _finalizers(rest, RESOURCE_CLAIM_TEMPLATES, "train-channel")
            ),
            timeout=60,
            what="the controller to take the domain (its finalizer, its template)",
        )
        assert rest.get(LEASES, NS, COMPONENT)["spec"]["holderIdentity"]

        def pods_of_the_deployment() -> None:  # kube-controller-manager and the kubelet, for this one Deployment
            while controller.poll() is None:
                try:
                    rest.get(DEPLOYMENTS, NS, DEPLOYMENT)
                except NotFound:
                    controller.send_signal(signal.SIGTERM)
                    return
                time.sleep(0.1)

        stand_in = threading.Thread(target=pods_of_the_deployment, daemon=True)
        stand_in.start()
        done = _cli(config, "--uninstall")
        assert done.returncode == 0, done.stderr
        assert f"deleted Deployment {NS}/{DEPLOYMENT}" in done.stdout
        assert f"removed finalizer {FINALIZER} from ComputeDomain {WORK}/train" in done.stdout
        assert f"removed finalizer {FINALIZER} from ResourceClaimTemplate {WORK}/train-channel" in done.stdout
        assert f"deleted Lease {NS}/{COMPONENT}" in done.stdout
        assert controller.wait(timeout=30) == 0, controller.stderr.read() if controller.stderr else ""
    finally:
        if controller.poll() is None:
            controller.kill()
            controller.wait()
    with pytest.raises(NotFound):  # the next install leads at once
        rest.get(LEASES, NS, COMPONENT)
    for resource, name in ((COMPUTE_DOMAINS, "train"), (RESOURCE_CLAIM_TEMPLATES, "train-channel")):
        assert rest.get(resource, WORK, name)["metadata"].get("finalizers") in (None, [])
    rest.delete(COMPUTE_DOMAINS, WORK, "train")  # as the CRD's deletion does: nothing holds it now
    with pytest.raises(NotFound):
        rest.get(COMPUTE_DOMAINS, WORK, "train")
    again = _cli(config, "--uninstall")  # idempotent: nothing left, said so
    assert again.returncode == 0, again.stderr
    assert "0 object(s) released" in again.stdout


def test_a_replica_that_keeps_the_lease_stops_the_uninstall_with_nothing_removed(
    server: fakes.apiserver.ApiServer,
) -> None:
    """Tried: a controller outside the Deployment (its holder renews the Lease throughout): the uninstall says who
    holds it and removes no finalizer, since that controller would only put them back."""
    rest = server.rest()
    domain = _domain("train", "train-channel")
    domain["metadata"]["finalizers"] = [FINALIZER]
    rest.create(COMPUTE_DOMAINS, WORK, domain)
    rest.create(
        LEASES,
        NS,
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": COMPONENT, "namespace": NS},
            "spec": {"holderIdentity": "elsewhere_1", "leaseDurationSeconds": 15, "renewTime": _stamp(0)},
        },
    )
    now = [0.0]

    def sleep(seconds: float) -> None:  # the holder renews while we wait
        now[0] += seconds
        lease = rest.get(LEASES, NS, COMPONENT)
        lease["spec"]["renewTime"] = _stamp(now[0])
        rest.replace(LEASES, lease)

    said: list[str] = []
    with pytest.raises(StillRunning, match=f"elsewhere_1 still holds the Lease {NS}/{COMPONENT} 60 s"):
        uninstall(rest, NS, COMPUTE_DOMAIN_CONTROLLER, say=said.append, clock=lambda: now[0], sleep=sleep)
    assert said == [f"deleted Deployment {NS}/{DEPLOYMENT}"]
    assert _finalizers(rest, COMPUTE_DOMAINS, "train") == [FINALIZER]
    assert rest.get(LEASES, NS, COMPONENT)["spec"]["holderIdentity"] == "elsewhere_1"


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(1_800_000_000 + t))
