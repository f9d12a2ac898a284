"""The arbiter's manifests: the Queue CRD (KAI v2 fields, status, printer columns) served by the API fake and
listed by kubectl; the arbiter's RBAC covers exactly the calls it makes; the admission policy adds the gate."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from agent.kube.rest import QUEUES, Resource
from agent.names import GATE, QUEUE_LABEL

DAEMONSET = pathlib.Path(__file__).resolve().parents[2] / "daemonset"  # tests/integration/ -> repo
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", False)


def docs(name: str) -> list[dict[str, Any]]:
    (path,) = DAEMONSET.rglob(name)
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_queue_crd_has_kais_fields_and_printer_columns() -> None:
    (crd,) = docs("queue-crd.yaml")
    assert crd["spec"]["group"] == "scheduling.gpu-dra-agent.io" and crd["spec"]["scope"] == "Cluster"
    (version,) = crd["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    assert {"parentQueue", "priority", "resources", "preemptMinRuntime", "reclaimMinRuntime"} <= set(spec)
    for resource in ("gpu", "cpu", "memory"):
        assert set(spec["resources"]["properties"][resource]["properties"]) == {"quota", "limit", "overQuotaWeight"}
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert {"allocated", "allocatedNonPreemptible", "requested", "fairShare"} <= set(status)
    assert version["subresources"] == {"status": {}}
    assert "GPU Fair Share" in [c["name"] for c in version["additionalPrinterColumns"]]


@pytest.fixture
def served() -> Any:
    apiserver = pytest.importorskip("fakes.apiserver")
    with apiserver.start(port=0) as server:
        rest = server.rest()
        (crd,) = docs("queue-crd.yaml")
        rest.create(CRDS, None, crd)
        yield server, rest


def kai_queue(name: str, **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1",
        "kind": "Queue",
        "metadata": {"name": name},
        "spec": {
            "parentQueue": "root",
            "priority": 100,
            "preemptMinRuntime": "5m",
            "resources": {
                "gpu": {"quota": 8, "limit": -1, "overQuotaWeight": 1},
                "cpu": {"quota": -1, "limit": -1, "overQuotaWeight": 1},
                "memory": {"quota": -1, "limit": -1, "overQuotaWeight": 1},
            },
            **extra,
        },
    }


def test_a_kai_queue_converts_by_its_api_version_and_bad_fields_are_refused(served: Any) -> None:
    _, rest = served
    rest.create(QUEUES, None, kai_queue("team-a"))
    rest.patch(
        QUEUES, None, "team-a", {"status": {"allocated": {"gpu": 4}, "fairShare": {"gpu": 8}}}, subresource="status"
    )
    assert rest.get(QUEUES, None, "team-a")["status"]["fairShare"] == {"gpu": 8}
    from agent.kube.errors import Invalid

    with pytest.raises(Invalid):  # tried: a quota that is not a number
        rest.create(QUEUES, None, kai_queue("bad", resources={"gpu": {"quota": "lots"}}))


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_get_queues_shows_the_columns(served: Any, tmp_path: pathlib.Path) -> None:
    server, rest = served
    rest.create(QUEUES, None, kai_queue("team-a"))
    rest.patch(
        QUEUES, None, "team-a", {"status": {"allocated": {"gpu": 4}, "fairShare": {"gpu": 8}}}, subresource="status"
    )
    config = server.write_kubeconfig(tmp_path / "kubeconfig")
    out = subprocess.run(
        ["kubectl", "--kubeconfig", str(config), "get", "queues"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    if out.returncode != 0 and "the server doesn't have a resource type" in out.stderr:
        pytest.skip("this API fake serves no discovery for custom resources yet")
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    if header.split() == ["NAME", "AGE"]:
        pytest.skip("this API fake's Table output ignores a CRD's printer columns")
    assert header.split()[:4] == ["NAME", "PARENT", "PRIORITY", "GPU"]
    assert row.split()[:3] == ["team-a", "root", "100"]


def rules_of(role: str) -> set[tuple[str, str, str]]:
    (found,) = [
        d
        for name in ("arbiter.yaml",)
        for d in docs(name)
        if d["kind"] in ("ClusterRole", "Role") and d["metadata"]["name"] == role
    ]
    return {
        (g, r, v)
        for rule in found["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }


def test_the_arbiter_rbac_is_what_it_calls() -> None:
    rules = rules_of("gpu-dra-agent-arbiter")
    writes = {(g, r, v) for g, r, v in rules if v not in ("get", "list", "watch")}
    assert writes == {
        ("", "pods", "update"),  # ungate and narrow node affinity
        ("", "pods/eviction", "create"),
        ("resource.k8s.io", "resourceclaims", "update"),  # the delete-protection finalizer
        ("resource.k8s.io", "resourceclaims/status", "update"),  # allocation and reservedFor
        # ... which kube-apiserver 1.36+ also checks as this (found on the real cluster: test_deployed.py)
        ("resource.k8s.io", "resourceclaims/binding", "update"),
        ("scheduling.gpu-dra-agent.io", "queues/status", "patch"),
        ("scheduling.gpu-dra-agent.io", "queues", "create"),  # the default Queue, when missing
        ("", "events", "create"),
        ("", "events", "patch"),
        # the fence: put back the DeviceTaintRule that keeps kube-scheduler off the driver's devices
        ("resource.k8s.io", "devicetaintrules", "create"),
        ("resource.k8s.io", "devicetaintrules", "update"),
    }
    reads = {(g, r) for g, r, v in rules if v == "watch"}
    assert reads == {
        ("", "pods"),
        ("", "nodes"),
        ("resource.k8s.io", "resourceclaims"),
        ("resource.k8s.io", "resourceslices"),
        ("resource.k8s.io", "deviceclasses"),
        ("scheduling.k8s.io", "podgroups"),
        ("scheduling.gpu-dra-agent.io", "queues"),
        ("resource.k8s.io", "devicetaintrules"),
    }
    assert rules_of("gpu-dra-agent-arbiter-leader") == {
        ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "get"),
        ("coordination.k8s.io", "leases", "update"),
    }


def test_the_admission_policy_gates_pods_that_name_a_queue() -> None:
    policy = next(d for d in docs("admission-gate.yaml") if d["kind"] == "MutatingAdmissionPolicy")
    conditions = " ".join(c["expression"] for c in policy["spec"]["matchConditions"])
    assert QUEUE_LABEL in conditions and GATE in policy["spec"]["mutations"][0]["jsonPatch"]["expression"]
    assert policy["spec"]["matchConstraints"]["resourceRules"][0]["operations"] == ["CREATE"]
    deployment = next(d for d in docs("arbiter.yaml") if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"][:3] == ["gpu-dra-agent", "arbiter", "--leader-elect"]


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("quota", -5, False),
        ("quota", -0.5, False),
        ("quota", -1, True),
        ("quota", 0, True),
        ("quota", 2.5, True),
        ("limit", -2, False),
        ("limit", -1, True),
        ("limit", 16, True),
        ("overQuotaWeight", -1, False),
        ("overQuotaWeight", 0, True),
        ("overQuotaWeight", 3, True),
    ],
)
def test_the_queue_schema_refuses_values_that_mean_nothing(served: Any, field: str, value: float, valid: bool) -> None:
    from agent.kube.errors import Invalid

    _, rest = served
    for resource in ("gpu", "cpu", "memory"):
        body = kai_queue(f"q-{resource}", resources={resource: {field: value}})
        if valid:
            rest.create(QUEUES, None, body)
            rest.delete(QUEUES, None, f"q-{resource}")
        else:
            with pytest.raises(Invalid, match=f"spec.resources.{resource}.{field}"):
                rest.create(QUEUES, None, body)


def test_every_queue_field_says_what_is_valid() -> None:
    (crd,) = docs("queue-crd.yaml")
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    for resource in ("gpu", "cpu", "memory"):
        for name, terms in spec["resources"]["properties"][resource]["properties"].items():
            assert "-1" in terms["description"] or name == "overQuotaWeight"
            assert "0 or more" in terms["description"] or "0 (none) or more" in terms["description"]
    assert "cycle" in spec["parentQueue"]["description"]


def test_the_queue_schema_holds_on_the_fake_and_on_kube_apiserver(cluster: Any) -> None:
    """The same CRD served by the API fake and by upstream's kube-apiserver (controlplane tier): -1 and >= 0
    pass, anything else is a 422 naming the field."""
    import time

    (crd,) = docs("queue-crd.yaml")
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    assert cluster.raw("POST", crds, crd).status == 201
    try:
        deadline = time.monotonic() + 30
        while not any(
            c["type"] == "Established" and c["status"] == "True"
            for c in (cluster.raw("GET", f"{crds}/{crd['metadata']['name']}").body.get("status") or {}).get(
                "conditions"
            )
            or ()
        ):
            assert time.monotonic() < deadline, "the CRD was not established"
            time.sleep(0.1)
        queues = "/apis/scheduling.gpu-dra-agent.io/v1alpha1/queues"
        deadline = time.monotonic() + 30
        while (answer := cluster.raw("POST", queues, kai_queue("ok"))).status == 404 and time.monotonic() < deadline:
            time.sleep(0.1)  # kube-apiserver serves a new CRD's endpoint a moment after Established
        assert answer.status == 201, answer
        for value, status in ((-1, 201), (0, 201), (2.5, 201), (-5, 422), (-0.5, 422)):
            answer = cluster.raw(
                "POST",
                queues,
                kai_queue(
                    f"q{status}-{abs(value)}".replace(".", "-"), resources={"gpu": {"quota": value, "limit": value}}
                ),
            )
            assert answer.status == status, (value, answer)
            if status == 422:
                assert "spec.resources.gpu.quota" in json.dumps(answer.body)
        answer = cluster.raw("POST", queues, kai_queue("w", resources={"cpu": {"overQuotaWeight": -1}}))
        assert answer.status == 422 and "spec.resources.cpu.overQuotaWeight" in json.dumps(answer.body)
    finally:
        cluster.raw("DELETE", f"{crds}/{crd['metadata']['name']}")
