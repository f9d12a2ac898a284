"""The API fake through the official client: CRUD, status ownership, errors, finalizers, subresources, CRDs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import yaml
from kubernetes import client, config, dynamic
from kubernetes.client import ApiException

import fakes.apiserver
from fakes.apiserver import ApiServer


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fakes.apiserver.start() as s:
        yield s


@pytest.fixture
def core(server: ApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(server.api_client())


@pytest.fixture
def resource(server: ApiServer) -> client.ResourceV1Api:
    return client.ResourceV1Api(server.api_client())


def slice_body(name: str, node: str = "node-a", devices: int = 1, generation: int = 1) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "nodeName": node,
            "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(devices)],
        },
    }


def claim_body(name: str) -> dict:
    return {
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }


def test_version_and_discovery(server: ApiServer) -> None:
    api_client = server.api_client()
    assert client.VersionApi(api_client).get_code().minor == str(server.version.minor)  # 1.37 unless overridden
    groups = {g.name for g in client.ApisApi(api_client).get_api_versions().groups}
    assert {"resource.k8s.io", "coordination.k8s.io", "events.k8s.io", "apiextensions.k8s.io"} <= groups
    names = {r.name for r in client.ResourceV1Api(api_client).get_api_resources().resources}
    assert {"resourceslices", "resourceclaims", "resourceclaims/status", "deviceclasses"} <= names


def test_node_crud_and_status_ownership(core: client.CoreV1Api) -> None:
    node = core.create_node(
        client.V1Node(
            metadata=client.V1ObjectMeta(name="node-a", labels={"zone": "a"}),
            spec=client.V1NodeSpec(unschedulable=False),
        )
    )
    assert node.metadata.uid and node.metadata.creation_timestamp and node.metadata.generation == 1
    # A status write changes only status, even when the body carries other changes.
    node.status = client.V1NodeStatus(capacity={"cpu": "8"})
    node.metadata.labels = {"zone": "changed-through-status"}
    after_status = core.replace_node_status("node-a", node)
    assert after_status.status.capacity == {"cpu": "8"}
    assert after_status.metadata.labels == {"zone": "a"}
    # A main-resource write leaves status alone.
    after_status.status = client.V1NodeStatus(capacity={"cpu": "1"})
    after_status.metadata.labels = {"zone": "b"}
    replaced = core.replace_node("node-a", after_status)
    assert replaced.status.capacity == {"cpu": "8"} and replaced.metadata.labels == {"zone": "b"}
    assert int(replaced.metadata.resource_version) > int(node.metadata.resource_version)
    assert [n.metadata.name for n in core.list_node().items] == ["node-a"]
    core.delete_node("node-a")
    with pytest.raises(ApiException) as err:
        core.read_node("node-a")
    assert err.value.status == 404 and json.loads(err.value.body)["reason"] == "NotFound"


def test_generation_bumps_only_on_spec_change(resource: client.ResourceV1Api) -> None:
    created = resource.create_resource_slice(slice_body("s1"))
    assert created.metadata.generation == 1
    body = slice_body("s1", devices=2)
    body["metadata"]["resourceVersion"] = created.metadata.resource_version
    grown = resource.replace_resource_slice("s1", body)
    assert grown.metadata.generation == 2
    relabelled = resource.patch_resource_slice("s1", {"metadata": {"labels": {"x": "y"}}})
    assert relabelled.metadata.generation == 2 and relabelled.metadata.labels == {"x": "y"}


def test_errors_already_exists_stale_version_not_found(resource: client.ResourceV1Api) -> None:
    first = resource.create_resource_slice(slice_body("s1"))
    # Creating the same name again is a 409 AlreadyExists.
    with pytest.raises(ApiException) as err:
        resource.create_resource_slice(slice_body("s1"))
    assert err.value.status == 409 and json.loads(err.value.body)["reason"] == "AlreadyExists"
    resource.patch_resource_slice("s1", {"metadata": {"labels": {"bump": "1"}}})
    # Updating with the resourceVersion from before that patch is a 409 Conflict.
    stale = slice_body("s1", devices=3)
    stale["metadata"]["resourceVersion"] = first.metadata.resource_version
    with pytest.raises(ApiException) as err:
        resource.replace_resource_slice("s1", stale)
    status = json.loads(err.value.body)
    assert err.value.status == 409 and status["reason"] == "Conflict" and status["kind"] == "Status"
    # Reading, replacing and deleting an unknown name is a 404.
    for call in (
        lambda: resource.read_resource_slice("missing"),
        lambda: resource.replace_resource_slice("missing", slice_body("missing")),
        lambda: resource.delete_resource_slice("missing"),
    ):
        with pytest.raises(ApiException) as err:
            call()
        assert err.value.status == 404
        assert json.loads(err.value.body)["details"] == {
            "name": "missing",
            "group": "resource.k8s.io",
            "kind": "resourceslices",
        }


def test_claim_status_subresource_and_templates(resource: client.ResourceV1Api) -> None:
    # Status sent on create is dropped: only the status subresource writes it.
    body = claim_body("c1")
    body["status"] = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u1"}]}
    claim = resource.create_namespaced_resource_claim("default", body)
    assert claim.status is None or not claim.status.reserved_for
    allocation = {
        "devices": {"results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]}
    }
    patched = resource.patch_namespaced_resource_claim_status(
        "c1", "default", {"status": {"allocation": allocation}, "metadata": {"labels": {"ignored": "yes"}}}
    )
    assert patched.status.allocation.devices.results[0].device == "gpu-0"
    assert not patched.metadata.labels
    # The claim spec is immutable.
    with pytest.raises(ApiException) as err:
        resource.patch_namespaced_resource_claim(
            "c1",
            "default",
            {"spec": {"devices": {"requests": [{"name": "other", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}},
        )
    assert err.value.status == 422 and "immutable" in err.value.body
    template = resource.create_namespaced_resource_claim_template(
        "default", {"metadata": {"name": "t1"}, "spec": {"spec": claim_body("x")["spec"]}}
    )
    assert template.spec.spec.devices.requests[0].name == "gpu"
    resource.create_device_class(
        {
            "metadata": {"name": "gpu.nvidia.com"},
            "spec": {"selectors": [{"cel": {"expression": 'device.driver == "gpu.nvidia.com"'}}]},
        }
    )
    assert [c.metadata.name for c in resource.list_device_class().items] == ["gpu.nvidia.com"]
    assert len(resource.list_resource_claim_for_all_namespaces().items) == 1


def test_generate_name(core: client.CoreV1Api) -> None:
    made = [
        core.create_namespaced_config_map("default", {"metadata": {"generateName": "cfg-"}, "data": {"a": "b"}})
        for _ in range(3)
    ]
    names = {m.metadata.name for m in made}
    assert len(names) == 3 and all(n.startswith("cfg-") and len(n) == 9 for n in names)


def test_finalizers_delay_deletion_until_removed(resource: client.ResourceV1Api) -> None:
    body = claim_body("c1")
    body["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
    resource.create_namespaced_resource_claim("default", body)
    resource.delete_namespaced_resource_claim("c1", "default")
    pending = resource.read_namespaced_resource_claim("c1", "default")
    assert pending.metadata.deletion_timestamp is not None
    # No new finalizers once deletion started.
    with pytest.raises(ApiException) as err:
        resource.patch_namespaced_resource_claim("c1", "default", {"metadata": {"finalizers": ["another/one"]}})
    assert err.value.status == 422
    resource.patch_namespaced_resource_claim("c1", "default", [{"op": "remove", "path": "/metadata/finalizers"}])
    with pytest.raises(ApiException) as err:
        resource.read_namespaced_resource_claim("c1", "default")
    assert err.value.status == 404


def test_node_deletion_collects_owned_slices(core: client.CoreV1Api, resource: client.ResourceV1Api) -> None:
    node = core.create_node({"metadata": {"name": "node-a"}})
    owned = slice_body("owned")
    owned["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "Node", "name": "node-a", "uid": node.metadata.uid}
    ]
    resource.create_resource_slice(owned)
    resource.create_resource_slice(slice_body("unowned", node="node-b"))
    core.delete_node("node-a")
    assert [s.metadata.name for s in resource.list_resource_slice().items] == ["unowned"]


def test_pod_status_eviction_and_binding(core: client.CoreV1Api) -> None:
    pod = {
        "metadata": {"name": "p1", "labels": {"app": "x"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
        "status": {"phase": "Running"},
    }
    created = core.create_namespaced_pod("default", pod)
    assert created.status.phase == "Pending"  # status is the server's on create
    # The real server answers a binding with a Status, which the client cannot read as a V1Binding: raw it is.
    binding = {"metadata": {"name": "p1"}, "target": {"kind": "Node", "name": "node-a"}}
    answer = core.create_namespaced_pod_binding("p1", "default", binding, _preload_content=False)
    assert json.loads(answer.data)["status"] == "Success"
    with pytest.raises(ApiException) as err:  # a bound pod cannot be bound again
        core.create_namespaced_pod_binding("p1", "default", binding, _preload_content=False)
    assert err.value.status == 409
    assert core.read_namespaced_pod("p1", "default").spec.node_name == "node-a"
    core.patch_namespaced_pod_status("p1", "default", {"status": {"phase": "Running"}})
    running = core.list_namespaced_pod("default", field_selector="status.phase=Running,spec.nodeName=node-a")
    assert [p.metadata.name for p in running.items] == ["p1"]
    core.create_namespaced_pod_eviction("p1", "default", {"metadata": {"name": "p1", "namespace": "default"}})
    assert core.list_namespaced_pod("default").items == []
    with pytest.raises(ApiException) as err:  # evicting a pod that is gone
        core.create_namespaced_pod_eviction("p1", "default", {"metadata": {"name": "p1"}})
    assert err.value.status == 404


def test_events_leases_configmaps(server: ApiServer, core: client.CoreV1Api) -> None:
    api_client = server.api_client()
    core.create_namespaced_event(
        "default",
        {
            "metadata": {"name": "e1"},
            "involvedObject": {"kind": "Node", "name": "node-a"},
            "reason": "MigConfigFailed",
            "message": "boom",
            "type": "Warning",
        },
    )
    found = core.list_namespaced_event("default", field_selector="reason=MigConfigFailed,involvedObject.name=node-a")
    assert [e.message for e in found.items] == ["boom"]
    events = client.EventsV1Api(api_client)
    events.create_namespaced_event(
        "default",
        {
            "metadata": {"name": "e2"},
            "eventTime": "2025-01-01T00:00:00.000000Z",
            "reason": "Prepared",
            "action": "Prepare",
            "reportingController": "gpu.nvidia.com/agent",
            "reportingInstance": "node-a",
            "type": "Normal",
            "note": "ok",
        },
    )
    assert events.read_namespaced_event("e2", "default").note == "ok"
    leases = client.CoordinationV1Api(api_client)
    lease = leases.create_namespaced_lease(
        "kube-system", {"metadata": {"name": "arbiter"}, "spec": {"holderIdentity": "a", "leaseDurationSeconds": 15}}
    )
    lease.spec.holder_identity = "b"
    assert leases.replace_namespaced_lease("arbiter", "kube-system", lease).spec.holder_identity == "b"
    core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}, "data": {"k": "v"}})
    assert core.read_namespaced_config_map("cm", "default").data == {"k": "v"}
    core.delete_namespaced_config_map("cm", "default")
    assert server.store.get("ConfigMap", "cm", "default") is None


QUEUE_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "queues.scheduling.example.com"},
    "spec": {
        "group": "scheduling.example.com",
        "scope": "Cluster",
        "names": {"plural": "queues", "singular": "queue", "kind": "Queue", "listKind": "QueueList"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"priority": {"type": "integer"}}},
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def test_crd_registers_a_validated_custom_resource(server: ApiServer) -> None:
    api_client = server.api_client()
    crd = client.ApiextensionsV1Api(api_client).create_custom_resource_definition(QUEUE_CRD)
    assert crd.metadata.name == "queues.scheduling.example.com"
    established = client.ApiextensionsV1Api(api_client).read_custom_resource_definition(crd.metadata.name)
    assert any(c.type == "Established" and c.status == "True" for c in established.status.conditions)
    custom = client.CustomObjectsApi(api_client)
    custom.create_cluster_custom_object(
        "scheduling.example.com",
        "v1",
        "queues",
        {
            "apiVersion": "scheduling.example.com/v1",
            "kind": "Queue",
            "metadata": {"name": "team-a"},
            "spec": {"priority": 5},
        },
    )
    # A string where the CRD schema says integer is a 422.
    with pytest.raises(ApiException) as err:
        custom.create_cluster_custom_object(
            "scheduling.example.com",
            "v1",
            "queues",
            {
                "apiVersion": "scheduling.example.com/v1",
                "kind": "Queue",
                "metadata": {"name": "bad"},
                "spec": {"priority": "high"},
            },
        )
    assert err.value.status == 422 and "spec.priority" in err.value.body
    custom.patch_cluster_custom_object_status(
        "scheduling.example.com", "v1", "queues", "team-a", {"status": {"allocated": 3}}
    )
    got = custom.get_cluster_custom_object("scheduling.example.com", "v1", "queues", "team-a")
    assert got["status"] == {"allocated": 3} and got["spec"] == {"priority": 5}
    # The dynamic client discovers the new type too.
    queues = dynamic.DynamicClient(server.api_client()).resources.get(
        api_version="scheduling.example.com/v1", kind="Queue"
    )
    assert [q.metadata.name for q in queues.get().items] == ["team-a"]


def test_register_custom_in_process(server: ApiServer) -> None:
    server.register_custom("scheduling.example.com", "v1alpha1", "podgroups", "PodGroup", namespaced=True)
    custom = client.CustomObjectsApi(server.api_client())
    custom.create_namespaced_custom_object(
        "scheduling.example.com",
        "v1alpha1",
        "default",
        "podgroups",
        {
            "apiVersion": "scheduling.example.com/v1alpha1",
            "kind": "PodGroup",
            "metadata": {"name": "g"},
            "spec": {"minMember": 2},
        },
    )
    assert server.store.get("scheduling.example.com/PodGroup", "g", "default")["spec"] == {"minMember": 2}
    # Custom resources take JSON merge patch; a strategic merge patch is a 415 as on a real server.
    with pytest.raises(ApiException) as err:
        custom.patch_namespaced_custom_object(
            "scheduling.example.com",
            "v1alpha1",
            "default",
            "podgroups",
            "g",
            {"spec": {"minMember": 3}},
            _content_type="application/strategic-merge-patch+json",
        )
    assert err.value.status == 415


def test_dynamic_client_on_builtin_types(server: ApiServer) -> None:
    dyn = dynamic.DynamicClient(server.api_client())
    slices = dyn.resources.get(api_version="resource.k8s.io/v1", kind="ResourceSlice")
    slices.create(body={"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", **slice_body("s1")})
    assert slices.get(name="s1").spec.pool.name == "node-a"


def test_kubeconfig_file_and_command_line(tmp_path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fakes.apiserver", "--port", "0", "--kubeconfig-out", str(kubeconfig)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        assert yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"] == url
        api = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))
        assert "default" in {n.metadata.name for n in api.list_namespace().items}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


def test_thirty_two_requests_at_once_keep_their_connections(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    # tried: the arbiter's 32 commit workers on one client; with the library's default pool (five connections
    # per CPU) each request beyond it dropped its connection and the next paid a new handshake
    from concurrent import futures

    from agent.kube.kubeconfig import connect
    from agent.kube.rest import NODES

    with fakes.apiserver.start(port=0) as server:
        rest = connect(str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        with caplog.at_level("WARNING", logger="urllib3.connectionpool"), futures.ThreadPoolExecutor(32) as pool:
            for _ in range(3):
                list(pool.map(lambda _: rest.list(NODES), range(32)))
    assert not [r for r in caplog.records if "Connection pool is full" in r.getMessage()]


def test_the_agents_writes_are_named_for_it_in_managed_fields() -> None:
    # what `kubectl get -o yaml --show-managed-fields` and the audit log show an operator: which component wrote
    from agent.kube.rest import NODES

    with fakes.apiserver.start(port=0) as server:
        created = server.rest().create(
            NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n", "labels": {"a": "b"}}}
        )
    assert [e["manager"] for e in created["metadata"]["managedFields"]] == ["gpu-dra-agent"]
