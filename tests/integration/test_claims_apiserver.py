"""Claims read through the official client from an API server (the fake and the real one), then prepared."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest

from agent.claims import cdi
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef
from agent.kube import errors
from agent.kube.claims import KubeClaimSource
from agent.kube.rest import Rest
from tests.integration.conftest import Cluster
from tests.unit.test_claims_support import DRIVER, NODE, claim, inventory, opaque

kubernetes = pytest.importorskip("kubernetes")


@pytest.fixture
def api(cluster: Cluster) -> Any:
    return cluster.api_client()


@pytest.fixture
def rest(cluster: Cluster) -> Rest:
    return cluster.rest()


def create_allocated(api: Any, name: str, devices: list[str], configs: list[dict[str, Any]] = ()) -> ClaimRef:  # type: ignore[assignment]
    resource = kubernetes.client.ResourceV1Api(api)
    template = claim("ignored", devices, name=name, configs=configs)
    created = resource.create_namespaced_resource_claim(
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": template["spec"],
        },
    )
    body = api.sanitize_for_serialization(created)
    body["status"] = template["status"]
    resource.replace_namespaced_resource_claim_status(name, "default", body)
    return ClaimRef("default", created.metadata.uid, name)


def preparer(rest: Rest, root: pathlib.Path) -> ClaimPreparer:
    return ClaimPreparer(
        PrepareSettings(node_name=NODE, driver_name=DRIVER, inventory=inventory, mig_caps=cdi.MigCaps(lambda: None)),
        state_dir=root / "state",
        cdi_root=root / "cdi",
        source=KubeClaimSource(rest),
        boot_id=lambda: "boot-1",
    )


def test_prepare_a_claim_from_the_api(api: Any, rest: Rest, tmp_path: pathlib.Path) -> None:
    mps = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 25}}
    ref = create_allocated(api, "train", ["gpu-1"], [opaque(sharing=mps)])
    source = KubeClaimSource(rest)
    fetched = source.get("default", "train")
    assert fetched["metadata"]["uid"] == ref.uid
    # opaque parameters arrive exactly as written
    assert fetched["status"]["allocation"]["devices"]["config"][0]["opaque"]["parameters"]["sharing"] == mps

    result = preparer(rest, tmp_path).prepare([ref])[ref.uid]
    assert result.error == ""
    assert [d.cdi_device_ids for d in result.devices] == [(f"k8s.gpu.nvidia.com/claim={ref.uid}-gpu-1",)]
    assert (tmp_path / "cdi" / cdi.spec_file_name(ref.uid)).exists()


def test_missing_claim_is_not_found(api: Any, rest: Rest, tmp_path: pathlib.Path) -> None:
    with pytest.raises(errors.NotFound):
        KubeClaimSource(rest).get("default", "nope")
    result = preparer(rest, tmp_path).prepare([ClaimRef("default", "u", "nope")])["u"]
    assert "cannot read ResourceClaim default/nope: API error 404" in result.error


def test_recreated_claim_is_refused(api: Any, rest: Rest, tmp_path: pathlib.Path) -> None:
    old = create_allocated(api, "c", ["gpu-0"])
    kubernetes.client.ResourceV1Api(api).delete_namespaced_resource_claim("c", "default", _preload_content=False)
    new = create_allocated(api, "c", ["gpu-0"])
    assert new.uid != old.uid
    result = preparer(rest, tmp_path).prepare([old])[old.uid]
    assert f"has UID {new.uid}, not {old.uid}" in result.error


def test_unallocated_claim_from_the_api(api: Any, rest: Rest, tmp_path: pathlib.Path) -> None:
    created = kubernetes.client.ResourceV1Api(api).create_namespaced_resource_claim(
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "pending"},
            "spec": claim("x")["spec"],
        },
    )
    ref = ClaimRef("default", created.metadata.uid, "pending")
    assert preparer(rest, tmp_path).prepare([ref])[ref.uid].error == "ResourceClaim default/pending is not allocated"
