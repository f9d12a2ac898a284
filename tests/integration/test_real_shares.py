"""Consumable capacity against the real control plane (1.37: DRAConsumableCapacity beta, on): the agent on a
fake DGX H100 with `--consumable-shares=memory`, kube-scheduler's own allocator placing ten `memory: 8Gi`
claims, the agent preparing every share, and the arbiter counting them. The fake scheduler, given the same
slices and the other claims, picks the same GPU and records the same consumed capacity for each."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import yaml

from agent.arbiter.world import build_world
from agent.claims import cdi
from agent.claims.types import ClaimRef
from agent.names import ADDRESS_ANNOTATION, FINGERPRINT_ANNOTATION, QUEUE_LABEL
from fakes.kubelet import FakeKubelet
from fakes.scheduler import allocate
from tests.controlplane.cluster import ControlPlane, reset, wait_for
from tests.integration.test_node_support import DRIVER, REPO, Daemon, short_tmpdir
from tests.integration.test_real_scheduling import NAMESPACE, Site, scheduled

pytestmark = pytest.mark.controlplane

NODE = "node-s"
CLAIMS = 10
H100_GIB = 81559 / 1024  # 79.6


@pytest.fixture(scope="module")
def site(control_plane: ControlPlane) -> Iterator[Site]:
    reset(control_plane)
    for doc in yaml.safe_load_all((REPO / "daemonset" / "base" / "deviceclasses.yaml").read_text()):
        control_plane.request("POST", "/apis/resource.k8s.io/v1/deviceclasses", doc)
    with short_tmpdir("cs-") as root:
        kubeconfig = control_plane.write_kubeconfig(root / "kubeconfig")
        control_plane.add_node(NODE)
        daemon = Daemon(
            root, kubeconfig, NODE, extra_args=("--consumable-shares", "memory"), machine="fake:dgx-h100"
        ).start()
        kubelet: FakeKubelet | None = None
        try:
            daemon.wait_serving(timeout=60)
            kubelet = FakeKubelet(daemon.kubelet_root)
            kubelet.wait_for_driver(DRIVER)
            yield Site(control_plane, control_plane.api_client(), {NODE: daemon}, {NODE: kubelet})
        finally:
            if kubelet is not None:
                kubelet.close()
            daemon.close()
            reset(control_plane)


def share_pod(site: Site, name: str) -> None:
    site.resource.create_namespaced_resource_claim(
        NAMESPACE,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": "gpu.nvidia.com",
                                "capacity": {"requests": {"memory": "8Gi"}},
                            },
                        }
                    ]
                }
            },
        },
    )
    site.core.create_namespaced_pod(
        NAMESPACE,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {QUEUE_LABEL: "inference"}},
            "spec": {
                "restartPolicy": "Never",
                "resourceClaims": [{"name": "gpu", "resourceClaimName": name}],
                "containers": [{"name": "ctr", "image": "busybox", "resources": {"claims": [{"name": "gpu"}]}}],
            },
        },
    )


def test_nine_8gi_shares_on_one_h100_the_tenth_on_another_prepared_and_counted(site: Site) -> None:
    published = site.devices(NODE)
    assert all(d.get("allowMultipleAllocations") for d in published.values()), "kube-apiserver dropped the shares"
    assert published["gpu-0"]["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi"

    names = [f"infer-{i}" for i in range(CLAIMS)]
    for name in names:
        share_pod(site, name)
        scheduled(site, name)  # one at a time, so the order is the order they were created
    claims = {
        n: dict(site.cp.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims/{n}"))
        for n in names
    }
    results = {n: c["status"]["allocation"]["devices"]["results"] for n, c in claims.items()}
    devices = [results[n][0]["device"] for n in names]
    assert devices[:9] == ["gpu-0"] * 9 and devices[9] not in ("gpu-0", None)
    assert all(r[0]["consumedCapacity"]["memory"] == "8Gi" for r in results.values())
    assert len({r[0]["shareID"] for r in results.values()}) == CLAIMS

    # the fake scheduler agrees: each claim, allocated beside the other nine, gets the same GPU and capacity
    slices = site.slices(NODE)
    classes = site.cp.request("GET", "/apis/resource.k8s.io/v1/deviceclasses")["items"]
    for name in names:
        fresh = copy.deepcopy(claims[name])
        fresh.pop("status")
        others = [c for n, c in claims.items() if n != name]
        [mine] = allocate(fresh, slices, classes, others, node=NODE)["devices"]["results"]
        real = results[name][0]
        assert (mine["device"], mine["consumedCapacity"]) == (real["device"], real["consumedCapacity"])

    # every share prepared, each its own CDI device with its limit for the container
    kubelet = site.kubelets[NODE]
    daemon = site.daemons[NODE]
    for name in names:
        c = claims[name]
        ref = ClaimRef(NAMESPACE, c["metadata"]["uid"], name)
        prepared = kubelet.prepare(DRIVER, [ref])[ref.uid]
        assert prepared.error == ""
        [device] = prepared.devices
        share_id = results[name][0]["shareID"]
        assert device.cdi_device_ids == (cdi.device_id(ref.uid, device.device_name, share_id),)
        spec = yaml.safe_load((daemon.cdi_root / cdi.spec_file_name(ref.uid)).read_text())
        [edits] = [d["containerEdits"] for d in spec["devices"]]
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M" in edits["env"]

    # the arbiter counts the nine on gpu-0 as 72/79.6 of a GPU in their queue
    node_obj = site.cp.request("GET", f"/api/v1/nodes/{NODE}")
    node_obj.setdefault("metadata", {}).setdefault("annotations", {}).update(
        {ADDRESS_ANNOTATION: "127.0.0.1:1", FINGERPRINT_ANNOTATION: "ab" * 32}
    )
    pods = site.cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
    queues = [{"metadata": {"name": "inference"}, "spec": {"resources": {"gpu": {"quota": 1, "limit": -1}}}}]
    world = build_world(
        pods=[p for p in pods if p["metadata"]["name"] in names[:9]],
        claims=list(claims.values()),
        pod_groups=[],
        queues=queues,
        nodes=[node_obj],
        slices=slices,
        driver=DRIVER,
        now=0.0,
    )
    held = sum(p.gpu_milli for j in world.snapshot.jobs for p in j.pods)
    assert held == round(9 * 8 / H100_GIB * 1000) == 904

    for name in names:
        c = claims[name]
        ref = ClaimRef(NAMESPACE, c["metadata"]["uid"], name)
        assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
        site.core.delete_namespaced_pod(name, NAMESPACE, grace_period_seconds=0)
    wait_for(
        "pods to go",
        lambda: True if not site.cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"] else None,
        timeout=30,
    )
