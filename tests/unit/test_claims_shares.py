"""Prepare and unprepare of consumable-capacity shares: several claims on one GPU, each its own CDI device."""

from __future__ import annotations

import pathlib
import uuid
from typing import Any

import pytest
import yaml

from agent.claims import cdi
from agent.claims.checkpoint import ClaimState
from agent.claims.preparer import ClaimPreparer
from agent.devices.shares import ShareMode
from tests.unit.test_claims_state import Node, ok
from tests.unit.test_claims_support import DRIVER, NODE, claim, opaque


def share(uid: str, memory: str = "8Gi", device: str = "gpu-0", share_id: str | None = None,
          requests: int = 1, **kwargs: Any) -> dict[str, Any]:
    body = claim(uid, [], **kwargs)
    body["status"]["allocation"]["devices"]["results"] = [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device,
         "shareID": share_id or str(uuid.uuid5(uuid.NAMESPACE_OID, f"{uid}-{i}")),
         "consumedCapacity": {"memory": memory, "shares": "1"}}
        for i in range(requests)
    ]
    return body


class SharedNode(Node):
    def preparer(self) -> ClaimPreparer:
        p = super().preparer()
        p.states.share_mode = ShareMode("memory")
        return p


@pytest.fixture
def node(tmp_path: pathlib.Path) -> SharedNode:
    return SharedNode(tmp_path)


def spec(node: Node, uid: str) -> dict[str, Any]:
    return dict(yaml.safe_load((node.cdi_root / cdi.spec_file_name(uid)).read_text()))


def test_nine_shares_of_one_gpu_are_prepared_each_with_its_own_cdi_device(node: SharedNode) -> None:
    preparer = node.preparer()
    refs = [node.add(share(f"uid-{i}")) for i in range(9)]
    results = preparer.prepare(refs)
    ids = set()
    for i, ref in enumerate(refs):
        [device] = ok(results[ref.uid])
        assert device.device_name == "gpu-0"
        share_id = str(uuid.uuid5(uuid.NAMESPACE_OID, f"uid-{i}-0"))
        assert device.cdi_device_ids == (f"{cdi.KIND}=uid-{i}-gpu-0-{share_id}",)
        ids.update(device.cdi_device_ids)
        [edits] = [d["containerEdits"] for d in spec(node, ref.uid)["devices"]]
        assert edits["env"] == ["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8192M"]
    assert len(ids) == 9
    assert set(node.checkpoint().values()) == {ClaimState.COMPLETED}


def test_prepare_is_idempotent_and_keeps_the_share_id(node: SharedNode) -> None:
    preparer = node.preparer()
    ref = node.add(share("uid-1"))
    first = ok(preparer.prepare([ref])["uid-1"])
    assert ok(node.preparer().prepare([ref])["uid-1"]) == first


def test_shares_that_would_exceed_the_gpu_are_refused_for_that_claim_only(node: SharedNode) -> None:
    preparer = node.preparer()
    refs = [node.add(share(f"uid-{i}", memory="30Gi")) for i in range(3)]
    results = preparer.prepare(refs)  # the factory's H100 has 80Gi: two fit, the third is refused
    ok(results["uid-0"])
    ok(results["uid-1"])
    error = results["uid-2"].error
    assert "share" in error and "of gpu-0 (memory=30Gi, shares=1) does not fit beside the 2 share(s)" in error
    assert "(memory=60Gi, shares=2 of memory=80Gi, shares=48)" in error
    assert node.checkpoint() == {"uid-0": ClaimState.COMPLETED, "uid-1": ClaimState.COMPLETED}
    assert cdi.spec_file_name("uid-2") not in node.spec_files()


def test_unprepare_of_one_share_leaves_the_others(node: SharedNode) -> None:
    preparer = node.preparer()
    refs = [node.add(share(f"uid-{i}")) for i in range(3)]
    preparer.prepare(refs)
    assert preparer.unprepare([refs[1]]) == {"uid-1": ""}
    assert node.spec_files() == {cdi.spec_file_name("uid-0"), cdi.spec_file_name("uid-2")}
    assert node.checkpoint() == {"uid-0": ClaimState.COMPLETED, "uid-2": ClaimState.COMPLETED}
    ok(preparer.prepare([refs[0]])["uid-0"])  # still prepared, same answer


def test_a_share_never_meets_a_whole_gpu_claim(node: SharedNode) -> None:
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("whole", ["gpu-0"]))])["whole"])
    error = preparer.prepare([node.add(share("part"))])["part"].error
    assert "already prepared for ResourceClaim default/claim-whole" in error and "as a whole device" in error
    ok(preparer.prepare([node.add(share("part1", device="gpu-1"))])["part1"])
    error = preparer.prepare([node.add(claim("whole1", ["gpu-1"]))])["whole1"].error
    assert "as a share" in error


def test_a_share_with_an_mps_config_is_refused(node: SharedNode) -> None:
    body = share("mps", configs=[opaque(sharing={"strategy": "MPS"})])
    error = node.preparer().prepare([node.add(body)])["mps"].error
    assert "its MPS config would change the whole GPU" in error


def test_a_share_of_a_mig_device_is_refused(node: SharedNode) -> None:
    error = node.preparer().prepare([node.add(share("m", device="gpu-4-mig-1g10gb-19-0"))])["m"].error
    assert "not a whole GPU" in error


def test_two_shares_of_one_gpu_in_one_claim_are_two_cdi_devices_with_one_limit(node: SharedNode) -> None:
    ref = node.add(share("two", memory="10Gi", requests=2))
    devices = ok(node.preparer().prepare([ref])["two"])
    assert len({d.cdi_device_ids for d in devices}) == 2
    envs = [d["containerEdits"]["env"] for d in spec(node, "two")["devices"]]
    assert envs == [["CUDA_DEVICE_ORDER=PCI_BUS_ID", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M"]] * 2


def test_the_spec_is_valid_cdi(node: SharedNode, shared_dir: pathlib.Path) -> None:
    from tests.unit.test_claims_support import cdi_validator

    ok(node.preparer().prepare([node.add(share("v"))])["v"])
    assert cdi_validator(shared_dir).is_valid(spec(node, "v"))
