"""The API fake's protobuf codec: every built-in object the project ships survives JSON -> protobuf -> JSON."""

from __future__ import annotations

import json
import pathlib

import pytest
import yaml

from fakes.apiserver import protobuf
from fakes.apiserver.errors import ApiError

DAEMONSET = pathlib.Path(__file__).resolve().parents[2] / "daemonset"


def shipped() -> list[dict[str, object]]:
    docs = [d for p in sorted(DAEMONSET.rglob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]
    return [d for d in docs if protobuf.encodable(d)]


def test_every_shipped_builtin_object_round_trips() -> None:
    objects = shipped()
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "DaemonSet", "ConfigMap", "DeviceClass", "ClusterRole"} <= kinds, kinds
    for obj in objects:
        expected = json.loads(json.dumps(obj).replace('"nvidia.com/gpu": 1', '"nvidia.com/gpu": "1"'))
        assert protobuf.decode(protobuf.encode(obj)) == expected, obj["kind"]  # a Quantity is a string


def test_custom_resources_have_no_message() -> None:
    assert not protobuf.encodable({"apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1", "kind": "Queue"})
    with pytest.raises(ValueError, match="no protobuf message"):
        protobuf.encode({"apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1", "kind": "Queue"})


def test_a_truncated_body_is_a_clear_400() -> None:
    body = protobuf.encode({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}})
    with pytest.raises(ApiError, match="not a valid ConfigMap|not a runtime.Unknown") as caught:
        protobuf.decode(body[:-3])
    assert caught.value.code == 400
