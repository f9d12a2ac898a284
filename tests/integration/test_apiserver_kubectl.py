"""kubectl (v1.32 on every machine here) against the API fake playing 1.37: validation through OpenAPI v3, apply
(client-side and server-side), server-side Table output, wait, watch and delete."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

import fakes.apiserver
from fakes.apiserver import ApiServer

KUBECTL = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed on this machine")
DAEMONSET = pathlib.Path(__file__).resolve().parents[2] / "daemonset"


class Kubectl:
    def __init__(self, server: ApiServer, home: pathlib.Path) -> None:
        self.kubeconfig = server.write_kubeconfig(home / "kubeconfig")
        self.cache = home / "cache"  # discovery and OpenAPI caches of this server only

    def argv(self, *args: str) -> list[str]:
        assert KUBECTL is not None
        return [KUBECTL, f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.cache}", *args]

    def run(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            self.argv(*args), input=stdin, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({done.returncode}): {done.stderr}")
        return done


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fakes.apiserver.start(kubernetes_version="1.37") as s:
        yield s


@pytest.fixture
def kubectl(server: ApiServer, tmp_path: pathlib.Path) -> Kubectl:
    return Kubectl(server, tmp_path)


def table(output: str) -> list[list[str]]:
    """kubectl's column output split into cells (columns are separated by at least two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in output.strip().splitlines()]


def manifests() -> list[pathlib.Path]:
    """What `kubectl apply -R -f daemonset/` reads: every manifest (the overlays' objects too: their patches are
    inline in files named `Kustomization`, which kubectl skips)."""
    return sorted(p for p in DAEMONSET.rglob("*.yaml") if p.name not in ("kustomization.yaml", "kustomization.yml"))


def test_apply_the_daemonset_directory_with_validation(server: ApiServer, kubectl: Kubectl) -> None:
    args = [a for path in manifests() for a in ("-f", str(path))]
    # kubectl applies files in name order, and objects in a namespace that does not exist yet are refused (as
    # NamespaceLifecycle refuses them): the namespace goes first, as on a real cluster.
    namespaces = [p for p in manifests() for d in yaml.safe_load_all(p.read_text()) if d and d["kind"] == "Namespace"]
    for path in namespaces:
        kubectl.run("apply", "-f", str(path))
    first = kubectl.run("apply", "--validate=strict", *args)
    documents = [d for p in manifests() for d in yaml.safe_load_all(p.read_text()) if d]
    assert first.stdout.count(" created") == len(documents) - len(namespaces), first.stdout
    for document in documents:
        rt = server.registry.find(f"{document['apiVersion'].rpartition('/')[0]}/{document['kind']}")
        namespace = document["metadata"].get("namespace", "default") if rt.namespaced else ""
        stored = server.store.get(f"{rt.group}/{rt.kind}", document["metadata"]["name"], namespace)
        assert stored is not None, document["metadata"]["name"]
        # Client-side apply records what it applied, for the next three-way merge.
        assert "kubectl.kubernetes.io/last-applied-configuration" in stored["metadata"]["annotations"]
    again = kubectl.run("apply", "--validate=strict", *args)
    # A template whose request leaves allocationMode/count to the server's defaults differs from the live
    # object in an atomic list, so kubectl sends it again: "configured", as against kube-apiserver 1.37 too.
    defaulted = [
        d
        for d in documents
        if d["kind"] == "ResourceClaimTemplate"
        and any("count" not in r.get("exactly", {}) for r in d["spec"]["spec"]["devices"]["requests"])
    ]
    assert defaulted and again.stdout.count(" configured") == len(defaulted), again.stdout
    assert again.stdout.count(" unchanged") == len(documents) - len(defaulted), again.stdout
    if any((DAEMONSET / name).exists() for name in ("kustomization.yaml", "Kustomization")):
        installed = kubectl.run("apply", "-k", str(DAEMONSET))  # the README's install: the kustomize base
        assert "daemonset.apps/gpu-dra-agent-node unchanged" in installed.stdout, installed.stdout


def test_objects_need_their_namespace(server: ApiServer, kubectl: Kubectl) -> None:
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c", "namespace": "team-a"}}
    done = kubectl.run("apply", "-f", "-", stdin=json.dumps(config), check=False)
    assert done.returncode == 1 and 'namespaces "team-a" not found' in done.stderr
    # kubectl's generators (create namespace, ...) send protobuf; manifests (apply/create -f) travel as JSON.
    kubectl.run("create", "namespace", "team-a")
    kubectl.run("apply", "-f", "-", stdin=json.dumps(config))
    # Deleting the namespace deletes what is in it, as the namespace controller does.
    kubectl.run("delete", "namespace", "team-a")
    assert server.store.get("ConfigMap", "c", "team-a") is None


def test_validation_rejects_unknown_fields_on_the_server(server: ApiServer, kubectl: Kubectl) -> None:
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "bad"}, "data": {"a": "b"}, "colour": "red"}
    done = kubectl.run("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert done.returncode == 1 and 'strict decoding error: unknown field "colour"' in done.stderr
    assert server.store.get("ConfigMap", "bad", "default") is None
    # --validate=false sends fieldValidation=Ignore: the unknown field is dropped, the rest stored.
    kubectl.run("apply", "--validate=false", "-f", "-", stdin=json.dumps(bad))
    assert "colour" not in server.store.get("ConfigMap", "bad", "default")


def slice_body(name: str, node: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0", "attributes": {"type": {"string": "gpu"}}}],
        },
    }


def test_get_prints_upstreams_columns(server: ApiServer, kubectl: Kubectl) -> None:
    resource = client.ResourceV1Api(server.api_client())
    resource.create_resource_slice(slice_body("node-a-gpu", "node-a"))
    rows = table(kubectl.run("get", "resourceslices").stdout)
    assert rows[0] == ["NAME", "NODE", "DRIVER", "POOL", "AGE"]
    assert rows[1][:4] == ["node-a-gpu", "node-a", "gpu.nvidia.com", "node-a"]
    claim = {
        "metadata": {"name": "c"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
    }
    resource.create_namespaced_resource_claim("default", claim)
    assert table(kubectl.run("get", "resourceclaims").stdout)[1][:2] == ["c", "pending"]
    resource.patch_namespaced_resource_claim_status(
        "c",
        "default",
        {
            "status": {
                "allocation": {
                    "devices": {
                        "results": [{"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}]
                    }
                },
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "1"}],
            }
        },
    )
    assert table(kubectl.run("get", "resourceclaims").stdout)[1][:2] == ["c", "allocated,reserved"]


def test_custom_resources_print_their_crd_columns(server: ApiServer, kubectl: Kubectl) -> None:
    from tests.integration.test_apiserver_versions import QUEUE_CRD

    kubectl.run("apply", "-f", "-", stdin=json.dumps(QUEUE_CRD))
    queue = {
        "apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1",
        "kind": "Queue",
        "metadata": {"name": "team-a"},
        "spec": {"priority": 7, "parentQueue": "root"},
    }
    kubectl.run("apply", "-f", "-", stdin=json.dumps(queue))
    rows = table(kubectl.run("get", "queues").stdout)
    assert rows == [["NAME", "PRIORITY", "PARENT"], ["team-a", "7", "root"]]
    # The custom object is validated against the CRD's schema.
    queue["spec"]["priority"] = "high"
    done = kubectl.run("apply", "-f", "-", stdin=json.dumps(queue), check=False)
    assert done.returncode == 1 and "spec.priority" in done.stderr


def test_server_side_apply_owns_fields_and_reports_conflicts(server: ApiServer, kubectl: Kubectl) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "labels": {"team": "a"}},
        "data": {"mode": "fast", "level": "1"},
    }
    done = kubectl.run("apply", "--server-side", "-f", "-", stdin=json.dumps(config))
    assert "serverside-applied" in done.stdout
    stored = server.store.get("ConfigMap", "settings", "default")
    [entry] = stored["metadata"]["managedFields"]
    assert (entry["manager"], entry["operation"]) == ("kubectl", "Apply")
    assert set(entry["fieldsV1"]["f:data"]) == {"f:mode", "f:level"}
    # Another manager changes a field kubectl applied: applying the old value again is a conflict...
    kubectl.run("label", "--overwrite", "configmap", "settings", "team=b")
    done = kubectl.run("apply", "--server-side", "-f", "-", stdin=json.dumps(config), check=False)
    assert done.returncode == 1
    assert 'conflict with "kubectl-label" using v1: .metadata.labels.team' in done.stderr
    # ...which --force-conflicts takes over.
    kubectl.run("apply", "--server-side", "--force-conflicts", "-f", "-", stdin=json.dumps(config))
    assert server.store.get("ConfigMap", "settings", "default")["metadata"]["labels"] == {"team": "a"}
    # A field the manager no longer applies is removed.
    del config["data"]["level"]
    kubectl.run("apply", "--server-side", "-f", "-", stdin=json.dumps(config))
    assert server.store.get("ConfigMap", "settings", "default")["data"] == {"mode": "fast"}


def pod(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "c", "image": "busybox"}]},
    }


def test_wait_for_a_condition_and_for_deletion(server: ApiServer, kubectl: Kubectl) -> None:
    core = client.CoreV1Api(server.api_client())
    core.create_namespaced_pod("default", pod("p"))
    waiting = subprocess.Popen(
        kubectl.argv("wait", "--for=condition=Ready", "pod/p", "--timeout=30s"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(1)
    assert waiting.poll() is None  # not ready yet
    core.patch_namespaced_pod_status(
        "p",
        "default",
        {"status": {"conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-11-23T00:00:00Z"}]}},
    )
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == 0 and "pod/p condition met" in out, err
    done = kubectl.run("wait", "--for=delete", "pod/p", "--timeout=2s", check=False)
    assert done.returncode == 1 and "timed out" in done.stderr
    kubectl.run("delete", "pod", "p", "--wait=false")
    kubectl.run("wait", "--for=delete", "pod/p", "--timeout=10s")


def test_get_watch_prints_new_objects(server: ApiServer, kubectl: Kubectl) -> None:
    core = client.CoreV1Api(server.api_client())
    core.create_namespaced_pod("default", pod("first"))
    watching = subprocess.Popen(
        kubectl.argv("get", "pods", "--watch", "--request-timeout=5s"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert watching.stdout is not None
    header = watching.stdout.readline()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert watching.stdout.readline().split()[0] == "first"
    core.create_namespaced_pod("default", pod("second"))
    line = watching.stdout.readline()
    watching.kill()
    watching.wait(timeout=10)
    assert line.split()[:3] == ["second", "0/1", "Pending"]


def test_delete_answers_as_upstreams_stores_do(server: ApiServer, kubectl: Kubectl) -> None:
    api_client = server.api_client()
    resource = client.ResourceV1Api(api_client)
    resource.create_resource_slice(slice_body("s1", "node-a"))
    resource.create_resource_slice(slice_body("s2", "node-b"))
    # resource.k8s.io stores set ReturnDeletedObject: the typed client gets the deleted slice back.
    deleted = resource.delete_resource_slice("s1")
    assert isinstance(deleted, client.V1ResourceSlice) and deleted.metadata.name == "s1"
    # A ConfigMap's store answers a Status.
    core = client.CoreV1Api(api_client)
    core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}})
    status = core.delete_namespaced_config_map("cm", "default")
    status = status if isinstance(status, dict) else status.to_dict()
    assert (status["kind"], status["status"]) == ("Status", "Success")
    done = kubectl.run("delete", "resourceslice", "s2")
    assert done.stdout.strip() == 'resourceslice.resource.k8s.io "s2" deleted'
    assert server.store.objects("ResourceSlice") == []
