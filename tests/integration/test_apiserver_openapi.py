"""OpenAPI documents and Table output of the API fake, read as kubectl reads them (raw HTTP)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

import fakes.apiserver
from fakes.apiserver import ApiServer
from tests.integration.test_apiserver_versions import QUEUE_CRD


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fakes.apiserver.start(kubernetes_version="1.37") as s:
        yield s


def get(server: ApiServer, path: str, accept: str = "application/json") -> tuple[int, Any]:
    request = urllib.request.Request(server.url + path, headers={"Accept": accept})
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def send(server: ApiServer, method: str, path: str, body: str, content_type: str) -> tuple[int, Any]:
    request = urllib.request.Request(
        server.url + path, body.encode(), method=method, headers={"Content-Type": content_type}
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def patch_operation(document: dict[str, Any], kind: str) -> dict[str, Any]:
    """The PATCH operation kubectl's field-validation check looks for (NewQueryParamVerifierV3)."""
    return next(
        ops["patch"]
        for ops in document["paths"].values()
        if "patch" in ops and ops["patch"]["x-kubernetes-group-version-kind"]["kind"] == kind
    )


def test_openapi_v3_lists_each_group_version_and_says_fields_are_validated(server: ApiServer) -> None:
    code, root = get(server, "/openapi/v3")
    assert code == 200 and {"api/v1", "apis/resource.k8s.io/v1", "apis/scheduling.k8s.io/v1beta1"} <= set(root["paths"])
    url = root["paths"]["apis/resource.k8s.io/v1"]["serverRelativeURL"]
    code, document = get(server, url)
    assert code == 200 and document["openapi"] == "3.0.0"
    patch = patch_operation(document, "ResourceSlice")
    assert {"name": "fieldValidation", "in": "query"}.items() <= next(
        p for p in patch["parameters"] if p["name"] == "fieldValidation"
    ).items()
    assert "application/strategic-merge-patch+json" in patch["requestBody"]["content"]
    schema = document["components"]["schemas"]["io.k8s.api.resource.v1.ResourceSlice"]
    assert schema["x-kubernetes-group-version-kind"] == [
        {"group": "resource.k8s.io", "kind": "ResourceSlice", "version": "v1"}
    ]
    # Every reference resolves inside the document, types are single OpenAPI types.
    text = json.dumps(document)
    for name in {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}:
        assert name in document["components"]["schemas"], name
    assert '"type": ["' not in text
    # The patch strategy kubectl's client-side apply merges containers by.
    pod = get(server, root["paths"]["api/v1"]["serverRelativeURL"])[1]["components"]["schemas"][
        "io.k8s.api.core.v1.PodSpec"
    ]
    assert pod["properties"]["containers"]["x-kubernetes-patch-merge-key"] == "name"


def test_openapi_serves_custom_resources_once_their_crd_exists(server: ApiServer) -> None:
    assert "apis/scheduling.gpu-dra-agent.io/v1alpha1" not in get(server, "/openapi/v3")[1]["paths"]
    assert (
        send(
            server,
            "POST",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            json.dumps(QUEUE_CRD),
            "application/json",
        )[0]
        == 201
    )
    root = get(server, "/openapi/v3")[1]
    document = get(server, root["paths"]["apis/scheduling.gpu-dra-agent.io/v1alpha1"]["serverRelativeURL"])[1]
    patch = patch_operation(document, "Queue")
    # Custom resources take no strategic merge patch.
    assert "application/strategic-merge-patch+json" not in patch["requestBody"]["content"]
    queue = document["components"]["schemas"]["io.gpu-dra-agent.scheduling.v1alpha1.Queue"]
    assert queue["properties"]["spec"]["properties"]["priority"] == {"type": "integer"}
    code, swagger = get(server, "/openapi/v2")
    assert code == 200 and swagger["swagger"] == "2.0"
    assert "io.gpu-dra-agent.scheduling.v1alpha1.Queue" in swagger["definitions"]
    # kubectl asks v2 for protobuf, which the fake does not speak: 406, as a server without that encoding.
    assert get(server, "/openapi/v2", "application/com.github.proto-openapi.spec.v2@v1.0+protobuf")[0] == 406


TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"


def test_table_output_lists_upstreams_columns_and_partial_metadata(server: ApiServer) -> None:
    body = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": "s1"},
        "spec": {
            "driver": "gpu.nvidia.com",
            "nodeName": "node-a",
            "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
        },
    }
    assert (
        send(server, "POST", "/apis/resource.k8s.io/v1/resourceslices", json.dumps(body), "application/json")[0] == 201
    )
    code, listed = get(server, "/apis/resource.k8s.io/v1/resourceslices", TABLE)
    assert code == 200 and (listed["kind"], listed["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert [c["name"] for c in listed["columnDefinitions"]] == ["Name", "Node", "Driver", "Pool", "Age"]
    [row] = listed["rows"]
    assert row["cells"][:4] == ["s1", "node-a", "gpu.nvidia.com", "node-a"]
    assert row["object"]["kind"] == "PartialObjectMetadata" and row["object"]["metadata"]["name"] == "s1"
    one = get(server, "/apis/resource.k8s.io/v1/resourceslices/s1?includeObject=Object", TABLE)[1]
    assert one["rows"][0]["object"]["spec"]["driver"] == "gpu.nvidia.com"
    # Without the Table media type the list is a list, as before.
    assert get(server, "/apis/resource.k8s.io/v1/resourceslices")[1]["kind"] == "ResourceSliceList"


def test_apply_patch_creates_then_merges(server: ApiServer) -> None:
    path = "/api/v1/namespaces/default/configmaps/cfg?fieldManager=ops"
    config = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: cfg\ndata:\n  a: '1'\n"
    code, created = send(server, "PATCH", path, config, "application/apply-patch+yaml")
    assert code == 201 and created["data"] == {"a": "1"}
    code, merged = send(
        server,
        "PATCH",
        path.replace("ops", "other"),
        config.replace("a: '1'", "b: '2'"),
        "application/apply-patch+yaml",
    )
    assert code == 200 and merged["data"] == {"a": "1", "b": "2"}
    assert [(e["manager"], e["operation"]) for e in merged["metadata"]["managedFields"]] == [
        ("ops", "Apply"),
        ("other", "Apply"),
    ]
    # Applying again what is already there writes nothing: the resourceVersion stays.
    _, again = send(server, "PATCH", path, config, "application/apply-patch+yaml")
    assert again["metadata"]["resourceVersion"] == merged["metadata"]["resourceVersion"]
    code, status = send(
        server, "PATCH", "/api/v1/namespaces/default/configmaps/cfg", config, "application/apply-patch+yaml"
    )
    assert code == 400 and "fieldManager is required" in status["message"]
