"""The fake plays one Kubernetes minor release: /version, discovery, schemas, ResourceSlice limits and the fields its
disabled feature gates drop. Each rule names where it lives upstream (k8s.io/kubernetes)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiException

import fakes.apiserver
from fakes.apiserver import ApiServer


def serve(version: str, **options: Any) -> ApiServer:
    return fakes.apiserver.start(kubernetes_version=version, **options)


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with serve("1.37") as s:
        yield s


def device(i: int, **extra: Any) -> dict[str, Any]:
    return {"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}, **extra}


def slice_body(
    name: str = "s1", devices: list[dict[str, Any]] | None = None, pool: str = "node-a", **spec: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 2},
            "nodeName": "node-a",
            **spec,
        },
    }
    if devices is not None:
        body["spec"]["devices"] = devices
    return body


def counter_sets(count: int) -> list[dict[str, Any]]:
    return [{"name": f"gpu-{i}-counters", "counters": {"memory": {"value": "80Gi"}}} for i in range(count)]


def consuming(i: int) -> dict[str, Any]:
    return device(i, consumesCounters=[{"counterSet": "gpu-0-counters", "counters": {"memory": {"value": "10Gi"}}}])


def tainted(i: int, effect: str = "NoSchedule") -> dict[str, Any]:
    return device(i, taints=[{"key": "gpu.nvidia.com/xid", "value": "79", "effect": effect}])


def invalid_fields(call: Any) -> dict[str, str]:
    with pytest.raises(ApiException) as err:
        call()
    status = json.loads(err.value.body)
    assert err.value.status == 422, status
    return {c["field"]: c["message"] for c in status["details"]["causes"]}


def create_slice(server: ApiServer, body: dict[str, Any]) -> Any:
    return client.ResourceV1Api(server.api_client()).create_resource_slice(body)


@pytest.mark.parametrize("version", ["1.34", "1.35", "1.36", "1.37"])
def test_version_and_served_groups_follow_the_version(version: str) -> None:
    with serve(version) as server:
        api_client = server.api_client()
        info = client.VersionApi(api_client).get_code()
        assert (info.major, info.minor, info.git_version) == ("1", version[2:], f"v{version}.0")
        groups = {g.name: [v.version for v in g.versions] for g in client.ApisApi(api_client).get_api_versions().groups}
        # The gang API (KEP-4671) is served as scheduling.k8s.io/v1beta1 from 1.37 only.
        assert ("v1beta1" in groups.get("scheduling.k8s.io", [])) == (version == "1.37")
        admission = {r.name for r in client.AdmissionregistrationV1Api(api_client).get_api_resources().resources}
        # MutatingAdmissionPolicy is GA (admissionregistration.k8s.io/v1) from 1.36.
        assert ("mutatingadmissionpolicies" in admission) == (version >= "1.36")


def test_unsupported_versions_and_gates_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="unsupported Kubernetes version '1.33'"):
        serve("1.33")
    with pytest.raises(ValueError, match="unknown feature gates"):
        serve("1.37", feature_gates={"NoSuchGate": True})
    run = subprocess.run(
        [sys.executable, "-m", "fakes.apiserver", "--kubernetes-version", "1.38"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "invalid choice: '1.38'" in run.stderr


def test_command_line_plays_the_version_asked_for(tmp_path: Any) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fakes.apiserver",
            "--kubernetes-version",
            "1.35",
            "--feature-gates",
            "DRADeviceTaints=true",
            "--kubeconfig-out",
            str(kubeconfig),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        config = client.Configuration()
        config.host = url
        api_client = client.ApiClient(config)
        assert client.VersionApi(api_client).get_code().minor == "35"
        # DRADeviceTaints is alpha (off) on 1.35; the flag turned it on, so taints are kept.
        created = client.ResourceV1Api(api_client).create_resource_slice(slice_body(devices=[tainted(0)]))
        assert created.spec.devices[0].taints[0].key == "gpu.nvidia.com/xid"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# validateResourceSliceSpec (pkg/apis/resource/validation/validation.go), 1.35+:
# "only one of `sharedCounters` or `devices` is allowed".
@pytest.mark.parametrize("version", ["1.35", "1.36", "1.37"])
def test_counters_and_devices_share_no_slice_from_1_35(version: str) -> None:
    with serve(version, feature_gates={"DRAPartitionableDevices": True}) as server:
        causes = invalid_fields(
            lambda: create_slice(server, slice_body(devices=[consuming(0)], sharedCounters=counter_sets(1)))
        )
        assert causes == {"spec": "only one of `sharedCounters` or `devices` is allowed"}
        # Split into a counters-only slice and a devices slice of the same pool, both are accepted.
        create_slice(server, slice_body("counters", sharedCounters=counter_sets(1)))
        create_slice(server, slice_body("devices", devices=[consuming(0)]))


def test_the_1_34_shape_keeps_counters_beside_devices() -> None:
    with serve("1.34", feature_gates={"DRAPartitionableDevices": True}) as server:
        created = create_slice(server, slice_body(devices=[consuming(0)], sharedCounters=counter_sets(1)))
        assert created.spec.shared_counters and created.spec.devices[0].consumes_counters


# validateResourceSliceSpec: ResourceSliceMaxDevices = 128, ResourceSliceMaxDevicesWithTaintsOrConsumesCounters = 64
# (pkg/apis/resource/types.go), chosen by haveDeviceTaints / haveConsumesCounters.
def test_device_limits_128_or_64_with_taints_or_counters(server: ApiServer) -> None:
    create_slice(server, slice_body("plain", devices=[device(i) for i in range(128)]))
    too_many = [device(i) for i in range(129)]
    causes = invalid_fields(lambda: create_slice(server, slice_body("too-many", devices=too_many)))
    assert causes == {"spec.devices": "must have at most 128 devices (is 129)"}
    with_taint = [device(i) for i in range(65)]
    with_taint[7] = tainted(7)
    causes = invalid_fields(lambda: create_slice(server, slice_body("tainted", devices=with_taint)))
    assert causes == {"spec.devices": "must have at most 64 devices (is 65)"}
    causes = invalid_fields(
        lambda: create_slice(server, slice_body("counting", devices=[consuming(i) for i in range(65)]))
    )
    assert causes == {"spec.devices": "must have at most 64 devices (is 65)"}
    create_slice(server, slice_body("tainted-64", devices=with_taint[:64], pool="node-b"))


# validateResourceSliceSpec: validateSet(spec.SharedCounters, ResourceSliceMaxCounterSets = 8);
# validateCounterSet: ResourceSliceMaxCountersPerCounterSet = 32; validateDevice:
# ResourceSliceMaxDeviceCounterConsumptionsPerDevice = 2.
def test_counter_set_limits_from_1_35(server: ApiServer) -> None:
    create_slice(server, slice_body("eight", sharedCounters=counter_sets(8)))
    causes = invalid_fields(lambda: create_slice(server, slice_body("nine", sharedCounters=counter_sets(9))))
    assert causes == {"spec.sharedCounters": "must have at most 8 counter sets (is 9)"}
    wide = counter_sets(1)
    wide[0]["counters"] = {f"c{i}": {"value": "1"} for i in range(33)}
    causes = invalid_fields(lambda: create_slice(server, slice_body("wide", sharedCounters=wide)))
    assert causes == {"spec.sharedCounters[0].counters": "must have at most 32 counters"}
    three = device(
        0,
        consumesCounters=[
            {"counterSet": f"gpu-{i}-counters", "counters": {"memory": {"value": "1"}}} for i in range(3)
        ],
    )
    causes = invalid_fields(lambda: create_slice(server, slice_body("three", devices=[three])))
    assert causes == {"spec.devices[0].consumesCounters": "must have at most 2 entries (is 3)"}


# dropDisabledDRADeviceTaintsFields (pkg/registry/resource/resourceslice/strategy.go): DRADeviceTaints is alpha,
# off, through 1.35 and on by default from 1.36, so taints are dropped on write before 1.36.
@pytest.mark.parametrize(("version", "kept"), [("1.34", False), ("1.35", False), ("1.36", True), ("1.37", True)])
def test_device_taints_are_stored_from_1_36(version: str, kept: bool) -> None:
    with serve(version) as server:
        created = create_slice(server, slice_body(devices=[tainted(0)]))
        assert (created.spec.devices[0].taints is not None) == kept
        stored = server.store.get("ResourceSlice", "s1")["spec"]["devices"][0]
        assert ("taints" in stored) == kept


def test_taint_limits_and_effects_per_version(server: ApiServer) -> None:
    # validateDeviceTaint: None is a valid effect from 1.35; DeviceTaintsMaxLength = 16 (4 in 1.34).
    create_slice(server, slice_body("none", devices=[tainted(0, "None")]))
    many = device(0, taints=[{"key": f"k{i}", "effect": "NoSchedule"} for i in range(17)])
    assert invalid_fields(lambda: create_slice(server, slice_body("many", devices=[many]))) == {
        "spec.devices[0].taints": "must have at most 16 taints (is 17)"
    }
    with serve("1.34", feature_gates={"DRADeviceTaints": True}) as old:
        assert invalid_fields(lambda: create_slice(old, slice_body("none", devices=[tainted(0, "None")]))) == {
            "spec.devices[0].taints[0].effect": "must be one of NoSchedule, NoExecute"
        }


# dropDisabledDRAPartitionableDevicesFields (resourceslice/strategy.go): alpha through 1.35, on from 1.36.
@pytest.mark.parametrize(("version", "kept"), [("1.34", False), ("1.35", False), ("1.36", True)])
def test_counters_are_dropped_where_partitionable_devices_are_off(version: str, kept: bool) -> None:
    with serve(version) as server:
        created = create_slice(server, slice_body(sharedCounters=counter_sets(1)))
        assert (created.spec.shared_counters is not None) == kept
        created = create_slice(server, slice_body("d", devices=[consuming(0)]))
        assert (created.spec.devices[0].consumes_counters is not None) == kept


def test_a_field_in_use_survives_an_update_with_the_gate_off() -> None:
    """The strategies drop a disabled field only when the old object does not use it (…FeatureInUse(oldSlice))."""
    with serve("1.36") as server:
        create_slice(server, slice_body(devices=[tainted(0)]))
        stored = server.store.get("ResourceSlice", "s1")
    with serve("1.35") as server:
        server.store.write(server.registry.find("ResourceSlice").key, stored, None)
        body = server.store.get("ResourceSlice", "s1")
        body["metadata"]["labels"] = {"changed": "yes"}
        replaced = client.ResourceV1Api(server.api_client()).replace_resource_slice("s1", body)
        assert replaced.spec.devices[0].taints[0].key == "gpu.nvidia.com/xid"


# dropDisabledDRAExtendedResourceFields (pkg/registry/resource/deviceclass/strategy.go): DRAExtendedResource alpha
# in 1.34-1.35, on from 1.36.
@pytest.mark.parametrize(("version", "kept"), [("1.35", False), ("1.36", True), ("1.37", True)])
def test_extended_resource_name_on_device_classes(version: str, kept: bool) -> None:
    with serve(version) as server:
        body = {
            "metadata": {"name": "gpu.nvidia.com"},
            "spec": {
                "extendedResourceName": "nvidia.com/gpu",
                "selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}],
            },
        }
        created = client.ResourceV1Api(server.api_client()).create_device_class(body)
        assert (created.spec.extended_resource_name == "nvidia.com/gpu") == kept


def pod(name: str, group: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "image": "busybox"}]}
    if group:
        spec["schedulingGroup"] = {"podGroupName": group}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def test_pod_groups_workloads_and_scheduling_group_on_1_37(server: ApiServer) -> None:
    custom = client.CustomObjectsApi(server.api_client())
    workload = {
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "Workload",
        "metadata": {"name": "train"},
        "spec": {"podGroupTemplates": [{"name": "workers", "schedulingPolicy": {"gang": {"minCount": 4}}}]},
    }
    custom.create_namespaced_custom_object("scheduling.k8s.io", "v1beta1", "default", "workloads", workload)
    group = {
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "PodGroup",
        "metadata": {"name": "train-workers"},
        "spec": {"schedulingPolicy": {"gang": {"minCount": 4}}},
    }
    created = custom.create_namespaced_custom_object("scheduling.k8s.io", "v1beta1", "default", "podgroups", group)
    assert created["spec"]["schedulingPolicy"]["gang"]["minCount"] == 4 and "status" not in created
    # Status is its own subresource, as for every type that has one.
    status = {
        "status": {
            "conditions": [
                {
                    "type": "PodGroupScheduled",
                    "status": "True",
                    "reason": "Scheduled",
                    "message": "",
                    "lastTransitionTime": "2026-11-23T00:00:00Z",
                }
            ]
        }
    }
    patched = custom.patch_namespaced_custom_object_status(
        "scheduling.k8s.io", "v1beta1", "default", "podgroups", "train-workers", status
    )
    assert patched["status"]["conditions"][0]["type"] == "PodGroupScheduled"
    # The 1.37 schema checks the gang policy: minCount is required.
    group["metadata"]["name"] = "bad"
    group["spec"]["schedulingPolicy"]["gang"] = {}
    causes = invalid_fields(
        lambda: custom.create_namespaced_custom_object("scheduling.k8s.io", "v1beta1", "default", "podgroups", group)
    )
    assert "'minCount' is a required property" in causes["spec.schedulingPolicy.gang"]
    # Pods join the group with spec.schedulingGroup.
    core = client.CoreV1Api(server.api_client())
    created_pod = core.create_namespaced_pod("default", pod("worker-0", "train-workers"))
    assert created_pod.spec.scheduling_group.pod_group_name == "train-workers"


def test_scheduling_group_is_dropped_where_generic_workload_is_off() -> None:
    """dropDisabled… in pkg/api/pod/util.go: spec.schedulingGroup needs GenericWorkload (off upstream by default)."""
    with serve("1.37", feature_gates={"GenericWorkload": False}) as server:
        created = client.CoreV1Api(server.api_client()).create_namespaced_pod("default", pod("p", "g"))
        assert created.spec.scheduling_group is None
        groups = {g.name for g in client.ApisApi(server.api_client()).get_api_versions().groups}
        assert "scheduling.k8s.io" not in groups


def test_leases_and_evictions(server: ApiServer) -> None:
    api_client = server.api_client()
    leases = client.CoordinationV1Api(api_client)
    lease = leases.create_namespaced_lease(
        "kube-system",
        {
            "metadata": {"name": "gpu-dra-agent-arbiter"},
            "spec": {"holderIdentity": "arbiter-a", "leaseDurationSeconds": 15},
        },
    )
    lease.spec.holder_identity = "arbiter-b"
    assert (
        leases.replace_namespaced_lease("gpu-dra-agent-arbiter", "kube-system", lease).spec.holder_identity
        == "arbiter-b"
    )
    lease.spec.holder_identity = "arbiter-c"  # written from the stale resourceVersion: the loser of the race
    with pytest.raises(ApiException) as err:
        leases.replace_namespaced_lease("gpu-dra-agent-arbiter", "kube-system", lease)
    assert err.value.status == 409
    core = client.CoreV1Api(api_client)
    core.create_namespaced_pod("default", pod("victim"))
    core.create_namespaced_pod_eviction(
        "victim",
        "default",
        {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": "victim"},
            "deleteOptions": {"gracePeriodSeconds": 30},
        },
    )
    assert server.store.get("Pod", "victim", "default") is None


QUEUE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "queues.scheduling.gpu-dra-agent.io"},
    "spec": {
        "group": "scheduling.gpu-dra-agent.io",
        "scope": "Cluster",
        "names": {"plural": "queues", "singular": "queue", "kind": "Queue", "listKind": "QueueList"},
        "versions": [
            {
                "name": "v1alpha1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority"},
                    {"name": "Parent", "type": "string", "jsonPath": ".spec.parentQueue"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "parentQueue": {"type": "string"},
                                    "priority": {"type": "integer"},
                                    "resources": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                                },
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def test_queue_crd_serves_validated_custom_objects(server: ApiServer) -> None:
    api_client = server.api_client()
    client.ApiextensionsV1Api(api_client).create_custom_resource_definition(QUEUE_CRD)
    custom = client.CustomObjectsApi(api_client)
    queue = {
        "apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1",
        "kind": "Queue",
        "metadata": {"name": "team-a"},
        "spec": {"priority": 10, "resources": {"gpu": {"quota": 8, "limit": -1, "overQuotaWeight": 1}}},
    }
    created = custom.create_cluster_custom_object("scheduling.gpu-dra-agent.io", "v1alpha1", "queues", queue)
    assert created["spec"]["resources"]["gpu"]["quota"] == 8
    queue["metadata"]["name"] = "bad"
    queue["spec"]["priority"] = "high"
    assert "spec.priority" in invalid_fields(
        lambda: custom.create_cluster_custom_object("scheduling.gpu-dra-agent.io", "v1alpha1", "queues", queue)
    )
    patched = custom.patch_cluster_custom_object_status(
        "scheduling.gpu-dra-agent.io", "v1alpha1", "queues", "team-a", {"status": {"allocated": {"gpu": 2}}}
    )
    assert patched["status"] == {"allocated": {"gpu": 2}} and patched["spec"]["priority"] == 10
