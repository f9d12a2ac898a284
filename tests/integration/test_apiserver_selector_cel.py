"""Device selectors and capacity in claims and templates, on the fake and on kube-apiserver 1.37 alike. Tried
before: the fake stored a claim whose selector does not parse, names no declared variable, is no bool, or
costs more than 1,000,000 (four nested `all` over 20-element lists); kube-apiserver refuses each at create (422
with the selector's field), so a test could pass on the fake with a claim no cluster can hold. A negative
capacity request or consumedCapacity, though, kube-apiserver 1.37 stores (its validation has no rule for
them), and so does the fake: the node is what refuses them."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.conftest import Cluster

CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"
TEMPLATES = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaimtemplates"


def nested(n: int) -> str:
    items = "[" + ", ".join(str(i) for i in range(n)) + "]"
    return f"{items}.all(a, {items}.all(b, {items}.all(c, {items}.all(d, a + b + c + d >= 0))))"


def spec(expression: str | None = None, capacity: str | None = None) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com"}
    if expression is not None:
        exactly["selectors"] = [{"cel": {"expression": expression}}]
    if capacity is not None:
        exactly["capacity"] = {"requests": {"memory": capacity}}
    return {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}}


def create(cluster: Cluster, name: str, claim_spec: dict[str, Any], template: bool) -> Any:
    if template:
        return cluster.raw(
            "POST",
            TEMPLATES,
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name},
                "spec": {"spec": claim_spec},
            },
        )
    return cluster.raw(
        "POST",
        CLAIMS,
        {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name}, "spec": claim_spec},
    )


REFUSED = [
    ("device.driver ==", "compilation failed"),  # does not parse
    ("nosuch == 1", "undeclared reference to 'nosuch'"),
    ("device.driver", "must evaluate to bool or the unknown type, not string"),
    ("1 + 2", "must evaluate to bool or the unknown type, not int"),
    (nested(20), "too complex, exceeds cost limit"),
]


@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
@pytest.mark.parametrize(("expression", "said"), REFUSED, ids=["syntax", "undeclared", "string", "int", "cost"])
def test_a_selector_kube_apiserver_cannot_compile_is_refused(
    cluster: Cluster, expression: str, said: str, template: bool
) -> None:
    answer = create(cluster, "bad", spec(expression), template)
    assert answer.status == 422, answer
    field = ("spec.spec" if template else "spec") + ".devices.requests[0].exactly.selectors[0].cel.expression"
    causes = {c.get("field"): c.get("message", "") for c in answer.body["details"]["causes"]}
    assert said in causes.get(field, ""), causes


@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_selectors_kube_apiserver_takes_are_taken(cluster: Cluster, template: bool) -> None:
    for i, expression in enumerate(
        [
            nested(10),  # 10,000 iterations: under the limit
            "device.driver == 'gpu.nvidia.com'",
            "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'",
            "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
            "device.attributes['gpu.nvidia.com'].exists(k, k.startsWith('a'))",
        ]
    ):
        answer = create(cluster, f"ok-{i}", spec(expression), template)
        assert answer.status == 201, (expression, answer)


def test_negative_capacity_is_stored_as_by_kube_apiserver(cluster: Cluster) -> None:
    answer = create(cluster, "negative", spec(capacity="-10Gi"), template=False)
    assert answer.status == 201, answer
    stored = answer.body
    stored["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpu",
                        "driver": "gpu.nvidia.com",
                        "pool": "p",
                        "device": "gpu-0",
                        "shareID": "8c3e4a7e-1111-4222-8333-944444444444",
                        "consumedCapacity": {"memory": "-10Gi"},
                    }
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}]
            },
        }
    }
    answer = cluster.raw("PUT", f"{CLAIMS}/negative/status", stored)
    assert answer.status == 200, answer
    assert answer.body["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] == {"memory": "-10Gi"}
