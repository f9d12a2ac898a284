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


def share(
    uid: str, memory: str = "8Gi", device: str = "gpu-0", share_id: str | None = None, requests: int = 1, **kwargs: Any
) -> dict[str, Any]:
    body = claim(uid, [], **kwargs)
    body["status"]["allocation"]["devices"]["results"] = [
        {
            "request": "gpu",
            "driver": DRIVER,
            "pool": NODE,
            "device": device,
            "shareID": share_id or str(uuid.uuid5(uuid.NAMESPACE_OID, f"{uid}-{i}")),
            "consumedCapacity": {"memory": memory, "shares": "1"},
        }
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


# --- consumedCapacity the published request policy could never have produced -----------------------------------


def with_consumed(uid: str, consumed: dict[str, str]) -> dict[str, Any]:
    body = share(uid)
    body["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"] = consumed
    return body


@pytest.mark.parametrize(
    ("consumed", "why"),
    [
        ({"memory": "-10Gi", "shares": "1"}, "its memory=-10Gi is not a value the request policy"),
        ({"shares": "1"}, "it names no memory, which every share of the device consumes"),
        ({"memory": "0", "shares": "1"}, "its memory=0 is not a value the request policy"),
        ({"memory": "8Gi"}, "it names no shares"),
        ({"memory": "8Gi", "shares": "1", "bandwidth": "1"}, "it consumes bandwidth, which the device does not have"),
        ({"memory": "lots", "shares": "1"}, "its memory 'lots' is not a quantity"),
        ({"memory": "1Gi", "shares": "1.5"}, "its shares=1500m is not a value the request policy"),
    ],
    ids=["negative", "memory-missing", "memory-zero", "shares-missing", "unknown", "no-quantity", "off-step"],
)
def test_a_share_the_policy_could_not_have_produced_is_that_claims_error(
    node: SharedNode, consumed: dict[str, str], why: str
) -> None:
    # Tried: a forged or corrupted allocation beside a good share in the same batch. Before, a negative share
    # was prepared (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=-10240M) and left room for more than the GPU has, and a
    # missing memory set no limit at all.
    preparer = node.preparer()
    bad, good = node.add(with_consumed("bad", consumed)), node.add(share("good", memory="70Gi"))
    results = preparer.prepare([bad, good])
    error = results["bad"].error
    assert why in error and "no allocation from this node's slices has that: refused" in error
    ok(results["good"])
    assert node.checkpoint() == {"good": ClaimState.COMPLETED}
    assert cdi.spec_file_name("bad") not in node.spec_files()


def test_with_a_share_count_a_share_without_shares_is_refused_not_prepared_as_a_third(tmp_path: pathlib.Path) -> None:
    # Tried: --consumable-shares 2, two shares of gpu-0, then a third whose consumedCapacity lacks `shares`.
    # Before, the third was prepared: a missing `shares` counted as none taken.
    node = SharedNode(tmp_path)
    preparer = node.preparer()
    preparer.states.share_mode = ShareMode("count", 2)
    refs = [node.add(with_consumed(f"s{i}", {"memory": "0", "shares": "1"})) for i in range(2)]
    third = node.add(with_consumed("s2", {"memory": "0"}))
    results = preparer.prepare([*refs, third])
    ok(results["s0"]), ok(results["s1"])
    assert "it names no shares" in results["s2"].error
    [edits] = [d["containerEdits"] for d in spec(node, "s0")["devices"]]
    assert "env" not in edits  # memory 0 is the policy's default under a share count: no memory limit, rightly
