"""A device-plugin-style pod (`nvidia.com/gpu: 2`) gets GPUs through DRA: the fake scheduler makes the special
claim as kube-scheduler does, allocates it, reserves it for the pod, binds the pod and records the mapping."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

import fakes.apiserver
from agent.kube.slices import SliceApi
from agent.slices.build import build_resource_slices
from fakes.scheduler import FakeScheduler
from fakes.scheduler.extended import CLAIM_ANNOTATION
from tests.unit.test_slices_factory import dgx_h100

DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"


def test_a_pod_asking_for_nvidia_com_gpu_gets_gpus_through_an_extended_resource_claim() -> None:
    with fakes.apiserver.start(port=0) as server:
        api = server.api_client()
        core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
        core.create_node({"metadata": {"name": "node-a"}})
        for device_class in yaml.safe_load_all((DAEMONSET / "base" / "deviceclasses.yaml").read_text()):
            resource.create_device_class(device_class)
        for s in build_resource_slices(dgx_h100(), "node-a"):
            SliceApi(server.rest()).create(s)
        pod: dict[str, Any] = {
            "metadata": {"name": "trainer", "namespace": "default"},
            "spec": {
                "containers": [{"name": "main", "image": "cuda", "resources": {"limits": {"nvidia.com/gpu": "2"}}}]
            },
        }
        uid = core.create_namespaced_pod("default", pod).metadata.uid

        scheduler = FakeScheduler(server.rest())
        claim = scheduler.schedule_extended_resources("default", "trainer", "node-a")
        assert claim is not None
        meta = claim["metadata"]
        assert meta["name"].startswith("trainer-extended-resources-")
        assert meta["annotations"][CLAIM_ANNOTATION] == "true"
        assert meta["ownerReferences"][0]["uid"] == uid
        assert "resource.kubernetes.io/delete-protection" in meta["finalizers"]
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [r["request"] for r in results] == ["container-0-request-0"] * 2
        assert len({r["device"] for r in results}) == 2
        assert claim["status"]["reservedFor"] == [{"resource": "pods", "name": "trainer", "uid": uid}]

        stored = server.store.get("Pod", "trainer", "default")
        assert stored is not None and stored["spec"]["nodeName"] == "node-a"
        assert stored["status"]["extendedResourceClaimStatus"] == {
            "resourceClaimName": meta["name"],
            "requestMappings": [
                {"containerName": "main", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
            ],
        }
        # A second cycle finds the allocated claim instead of making another.
        again = scheduler.schedule_extended_resources("default", "trainer", "node-a")
        assert again is not None and again["metadata"]["name"] == meta["name"]
        assert len(server.store.objects("ResourceClaim")) == 1
