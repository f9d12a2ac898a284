"""Prepare creates the MIG placement a claim was allocated (a partitionable device); unprepare, rollback and
recovery destroy it; MIG devices an operator made are never destroyed. A fake MigDevices records calls.

The inventory is discovered from the NVML fake's `mixed-mig` machine: GPUs 0 and 1 carry the operator's
static all-balanced layout (3g at 4, 2g at 0, 1g at 2 and 3), GPU 2 has MIG mode on and no instances, GPU 3
has MIG mode off.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

import pynvml
import pytest
import yaml

from agent.claims import cdi
from agent.claims.checkpoint import (
    Checkpoint,
    CheckpointedDevice,
    CheckpointStore,
    ClaimEntry,
    ClaimState,
    DynamicMig,
    decode_record,
    encode_record,
)
from agent.claims.mig import MigDevices
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef, PrepareResult
from agent.devices.model import Inventory
from agent.nvml.source import open_nvml
from tests.claim_sources import StaticClaimSource
from tests.unit.test_claims_support import DRIVER, NODE, claim, opaque

FREE_1G = "gpu-2-mig-1g10gb-19-3"  # a free placement on GPU 2
FREE_3G = "gpu-2-mig-3g40gb-9-4"
STATIC_3G = "gpu-0-mig-3g40gb-9-4"  # made by the operator
OVERLAPS_STATIC = "gpu-0-mig-1g10gb-19-5"  # inside the static 3g
MIG_OFF = "gpu-3-mig-1g10gb-19-0"


class Crash(BaseException):
    """The agent dies here (not an Exception, so nothing in prepare catches it)."""


@pytest.fixture(scope="module")
def inventory() -> Inventory:
    with open_nvml("fake:mixed-mig") as nvml:
        h = pynvml.nvmlDeviceGetHandleByIndex(2)
        assert pynvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == 0
        return nvml.discover()


@dataclass(frozen=True)
class Made:
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str


@dataclass
class FakeMigs:
    """MIG devices by (parent uuid, GI id) -> (profile id, start); failures and crashes on demand."""

    live: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)
    create_error: BaseException | None = None
    create_errors_after: int = 0  # creates that succeed before `create_error` is raised
    crash_after_create: bool = False
    destroy_error: BaseException | None = None
    mode_error: BaseException | None = None
    mig_on: dict[str, bool] = field(default_factory=dict)  # MIG mode each switch_mig_mode call left

    def create(self, parent: str, gi_profile_id: int, start: int) -> Made:
        self.calls.append(f"create {gi_profile_id}@{start}")
        if self.create_error is not None:
            if self.create_errors_after == 0:
                raise self.create_error
            self.create_errors_after -= 1
        gi = 100 + start
        self.live[parent, gi] = (gi_profile_id, start)
        if self.crash_after_create:
            raise Crash
        return Made(gi, 0, f"MIG-{gi_profile_id:04d}{start:04d}-0000-0000-0000-000000000000")

    def destroy(self, parent: str, gpu_instance_id: int, compute_instance_id: int | None) -> None:
        self.calls.append(f"destroy gi {gpu_instance_id}")
        if self.destroy_error is not None:
            raise self.destroy_error
        self.live.pop((parent, gpu_instance_id), None)

    def destroy_at(self, parent: str, gi_profile_id: int, start: int) -> bool:
        self.calls.append(f"destroy_at {gi_profile_id}@{start}")
        key = next((k for k, v in self.live.items() if k[0] == parent and v == (gi_profile_id, start)), None)
        return key is not None and self.live.pop(key) is not None

    def switch_mig_mode(self, parent: str, enabled: bool) -> None:
        self.calls.append(f"mig {'on' if enabled else 'off'} {parent[:12]}")
        if self.mode_error is not None:
            raise self.mode_error
        self.mig_on[parent] = enabled

    def placements(self) -> set[tuple[int, int]]:
        return set(self.live.values())


@dataclass
class Node:
    root: pathlib.Path
    inventory: Inventory
    migs: FakeMigs = field(default_factory=FakeMigs)
    source: StaticClaimSource = field(default_factory=StaticClaimSource)
    changes: int = 0

    def preparer(self, migs: MigDevices | None = None, *, with_migs: bool = True) -> ClaimPreparer:
        def changed() -> None:
            self.changes += 1

        return ClaimPreparer(
            PrepareSettings(
                node_name=NODE,
                driver_name=DRIVER,
                inventory=lambda: self.inventory,
                mig_caps=cdi.MigCaps(lambda: None),
                migs=(migs or self.migs) if with_migs else None,
                on_inventory_changed=changed,
            ),
            state_dir=self.root / "state",
            cdi_root=self.root / "cdi",
            source=self.source,
            boot_id=lambda: "boot-1",
            lock_timeout=0.2,
        )

    def add(self, uid: str, devices: list[str], **kw: Any) -> ClaimRef:
        self.source.put(claim(uid, devices, request="mig", **kw))
        return ClaimRef("default", uid, f"claim-{uid}")

    def checkpoint(self) -> Checkpoint:
        return CheckpointStore(self.root / "state", lambda: "boot-1").load()

    def spec(self, uid: str) -> dict[str, Any] | None:
        path = self.root / "cdi" / cdi.spec_file_name(uid)
        return yaml.safe_load(path.read_text()) if path.exists() else None


@pytest.fixture
def node(tmp_path: pathlib.Path, inventory: Inventory) -> Node:
    return Node(tmp_path, inventory)


def ok(result: PrepareResult) -> PrepareResult:
    assert result.error == ""
    return result


def test_prepare_creates_the_allocated_placement_and_the_spec_names_it(node: Node) -> None:
    ref = node.add("u1", [FREE_1G])
    [device] = ok(node.preparer().prepare([ref])["u1"]).devices
    assert device.device_name == FREE_1G
    assert node.migs.placements() == {(19, 3)}
    gpu2 = node.inventory.gpu(2)
    assert gpu2 is not None
    spec = node.spec("u1")
    assert spec is not None
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    gi_cap, ci_cap = cdi.default_mig_minor(2, 103), cdi.default_mig_minor(2, 103, 0)
    assert nodes == ["/dev/nvidia2", f"/dev/nvidia-caps/nvidia-cap{gi_cap}", f"/dev/nvidia-caps/nvidia-cap{ci_cap}"]
    entry = node.checkpoint().claims["u1"]
    assert entry.state is ClaimState.COMPLETED
    assert entry.devices[0].dynamic_mig == DynamicMig(gpu2.uuid, 19, 3, 103, 0)
    assert node.changes == 1  # the node agent re-discovers


def test_the_placement_is_on_disk_before_the_device_is_created(node: Node) -> None:
    seen: list[tuple[ClaimState, DynamicMig | None]] = []

    class Watching(FakeMigs):
        def create(self, parent: str, gi_profile_id: int, start: int) -> Made:
            entry = node.checkpoint().claims["u1"]
            seen.append((entry.state, entry.devices[0].dynamic_mig))
            return super().create(parent, gi_profile_id, start)

    ref = node.add("u1", [FREE_1G])
    ok(node.preparer(Watching()).prepare([ref])["u1"])
    [(state, plan)] = seen
    assert state is ClaimState.STARTED and plan is not None
    assert (plan.gi_profile_id, plan.start, plan.created) == (19, 3, False)


def test_a_failed_create_is_the_claims_error_and_leaves_nothing(node: Node) -> None:
    node.migs.create_error = RuntimeError("Insufficient resources: placement taken or profile limit reached")
    good, bad = node.add("good", ["gpu-1-mig-2g20gb-14-0"]), node.add("bad", [FREE_1G])
    results = node.preparer().prepare([good, bad])
    assert "cannot create MIG device gpu-2-mig-1g10gb-19-3: Insufficient resources: placement taken" in (
        results["bad"].error
    )
    ok(results["good"])  # one claim's failure is not the batch's
    assert node.spec("bad") is None
    assert set(node.checkpoint().claims) == {"good"}
    assert node.migs.placements() == set()


def test_a_claim_whose_second_device_cannot_be_created_destroys_the_first(node: Node) -> None:
    node.migs.create_error, node.migs.create_errors_after = RuntimeError("no room"), 1
    ref = node.add("u1", [FREE_1G, "gpu-2-mig-1g10gb-19-0"])
    assert "no room" in node.preparer().prepare([ref])["u1"].error
    assert node.migs.calls == ["create 19@3", "create 19@0", "destroy gi 103"]
    assert node.migs.placements() == set()
    assert node.checkpoint().claims == {}


def test_a_create_that_left_something_behind_is_repaired_on_the_next_prepare(node: Node) -> None:
    class LeftBehind(RuntimeError):
        left_behind = True

    class Leaky(FakeMigs):
        def create(self, parent: str, gi_profile_id: int, start: int) -> Made:
            if not self.calls:
                self.calls.append("create (leaks)")
                self.live[parent, 100 + start] = (gi_profile_id, start)
                raise LeftBehind("compute instance failed; cleaning up failed too")
            return super().create(parent, gi_profile_id, start)

    migs = Leaky()
    ref = node.add("u1", [FREE_1G])
    assert "cleaning up failed too" in node.preparer(migs).prepare([ref])["u1"].error
    assert node.checkpoint().claims["u1"].state is ClaimState.STARTED  # kept: it names the leftover
    ok(node.preparer(migs).prepare([ref])["u1"])
    assert migs.calls == ["create (leaks)", "destroy_at 19@3", "create 19@3"]
    assert migs.placements() == {(19, 3)}


def test_a_crash_right_after_creating_is_rolled_back_at_restart(node: Node) -> None:
    node.migs.crash_after_create = True
    ref = node.add("u1", [FREE_1G])
    with pytest.raises(Crash):
        node.preparer().prepare([ref])
    assert node.migs.placements() == {(19, 3)}  # made, ids never saved
    node.migs.crash_after_create = False
    recovery = node.preparer().recover()
    assert recovery.rolled_back == ("u1",)
    assert node.migs.placements() == set()  # found by its placement and destroyed
    assert node.checkpoint().claims == {}


def test_a_crash_before_completed_is_rolled_back_and_the_retry_creates_again(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = node.add("u1", [FREE_1G])
    preparer = node.preparer()

    def crash(uid: str, spec: Any) -> pathlib.Path:
        raise Crash

    monkeypatch.setattr(preparer.states.specs, "write", crash)
    with pytest.raises(Crash):
        preparer.prepare([ref])
    assert node.checkpoint().claims["u1"].state is ClaimState.STARTED
    ok(node.preparer().prepare([ref])["u1"])  # the kubelet retries: roll back, then prepare anew
    assert node.migs.calls == ["create 19@3", "destroy_at 19@3", "create 19@3"]
    assert node.migs.placements() == {(19, 3)}


def test_unprepare_destroys_the_device_the_claim_created(node: Node) -> None:
    ref = node.add("u1", [FREE_3G])
    preparer = node.preparer()
    ok(preparer.prepare([ref])["u1"])
    assert preparer.unprepare([ref]) == {"u1": ""}
    assert node.migs.placements() == set()
    assert node.spec("u1") is None and node.checkpoint().claims == {}
    assert node.changes == 2  # created, destroyed


def test_a_crash_during_unprepare_leaves_an_entry_that_recovery_uses_to_destroy(node: Node) -> None:
    ref = node.add("u1", [FREE_1G])
    ok(node.preparer().prepare([ref])["u1"])
    node.migs.destroy_error = Crash()
    with pytest.raises(Crash):
        node.preparer().unprepare([ref])
    assert node.checkpoint().claims["u1"].state is ClaimState.STARTED  # still names the device
    node.migs.destroy_error = None
    assert node.preparer().recover().rolled_back == ("u1",)
    assert node.migs.placements() == set()


def test_a_device_still_in_use_fails_unprepare_and_keeps_the_claim_until_a_retry(node: Node) -> None:
    ref = node.add("u1", [FREE_1G])
    ok(node.preparer().prepare([ref])["u1"])
    node.migs.destroy_error = RuntimeError("In use by another client")
    errors = node.preparer().unprepare([ref])
    assert "cannot destroy MIG device gpu-2-mig-1g10gb-19-3" in errors["u1"] and "In use" in errors["u1"]
    assert set(node.checkpoint().claims) == {"u1"} and node.migs.placements() == {(19, 3)}
    node.migs.destroy_error = None
    assert node.preparer().unprepare([ref]) == {"u1": ""}
    assert node.migs.placements() == set() and node.checkpoint().claims == {}


def test_static_mig_devices_are_used_but_never_destroyed(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = node.add("u1", [STATIC_3G])
    preparer = node.preparer()
    ok(preparer.prepare([ref])["u1"])
    static = next(m for m in node.inventory.mig_devices if m.parent_minor == 0 and m.placement.start == 4)
    spec = node.spec("u1")
    assert spec is not None
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes == list(cdi.mig_device_nodes(0, static.gpu_instance_id, static.compute_instance_id, cdi.MigCaps()))
    assert preparer.unprepare([ref]) == {"u1": ""}

    other = node.add("u2", [STATIC_3G])
    monkeypatch.setattr(preparer.states.specs, "write", lambda uid, spec: (_ for _ in ()).throw(Crash()))
    with pytest.raises(Crash):
        preparer.prepare([other])
    assert node.checkpoint().claims == {}  # its spec was its only side effect: no Started record to roll back
    monkeypatch.undo()
    ok(preparer.prepare([other])["u2"])
    store = CheckpointStore(node.root / "state", lambda: "boot-1")  # as a crashed prepare that saved Started
    cp = store.load()
    cp.claims["u2"] = replace(cp.claims["u2"], state=ClaimState.STARTED)
    store.save(cp)
    assert node.preparer().recover().rolled_back == ("u2",)
    assert node.migs.calls == []  # neither unprepare nor rollback touched the operator's device
    assert node.changes == 0


@pytest.mark.parametrize(
    ("device", "why"),
    [
        (OVERLAPS_STATIC, "placement taken"),  # slice 5 lies inside the operator's 3g at 4
        ("gpu-2-mig-2g20gb-14-1", "1 is not a placement of 2g.20gb"),
        ("gpu-2-mig-5g50gb-77-0", "nor is it a MIG profile of a GPU there"),
        ("gpu-9-mig-1g10gb-19-0", "nor is it a MIG profile of a GPU there"),
    ],
)
def test_a_placement_that_cannot_be_created_is_refused_without_trying(node: Node, device: str, why: str) -> None:
    ref = node.add("u1", [device])
    error = node.preparer().prepare([ref])["u1"].error
    assert f"MIG device {device} does not exist on node {NODE}" in error and why in error
    assert node.migs.calls == [] and node.checkpoint().claims == {}


def test_a_placement_overlapping_another_claims_creation_is_refused(node: Node) -> None:
    # The inventory is not refreshed here: the checkpoint alone tells that slices 4..7 are now taken.
    preparer = node.preparer()
    ok(preparer.prepare([node.add("u1", [FREE_3G])])["u1"])
    error = preparer.prepare([node.add("u2", ["gpu-2-mig-1g10gb-19-5"])])["u2"].error
    assert "placement taken" in error
    assert node.migs.calls == ["create 9@4"]


def test_two_placements_of_one_claim_that_overlap_are_refused(node: Node) -> None:
    error = node.preparer().prepare([node.add("u1", [FREE_3G, "gpu-2-mig-1g10gb-19-4"])])["u1"].error
    assert "gpu-2-mig-1g10gb-19-4 does not exist" in error and "placement taken" in error
    assert node.migs.calls == []


def test_without_mig_control_a_missing_placement_is_an_error(node: Node) -> None:
    error = node.preparer(with_migs=False).prepare([node.add("u1", [FREE_1G])])["u1"].error
    assert "this agent does not create MIG devices" in error


def test_claims_sharing_a_created_device_destroy_it_with_the_last_one(node: Node) -> None:
    shared = [opaque("MigDeviceConfig", sharing={"strategy": "TimeSlicing"})]
    a, b = node.add("a", [FREE_1G], configs=shared), node.add("b", [FREE_1G], configs=shared)
    preparer = node.preparer()
    ok(preparer.prepare([a])["a"])
    ok(preparer.prepare([b])["b"])  # shares the device the first claim created
    assert node.migs.calls == ["create 19@3"]
    specs = [node.spec(uid) for uid in ("a", "b")]
    assert specs[0] is not None and specs[1] is not None
    assert specs[0]["containerEdits"]["env"][0] == specs[1]["containerEdits"]["env"][0]  # same MIG uuid
    assert preparer.unprepare([a]) == {"a": ""}
    assert node.migs.placements() == {(19, 3)}  # b still uses it
    assert preparer.unprepare([b]) == {"b": ""}
    assert node.migs.placements() == set()


def test_checkpoint_keeps_the_created_device_and_reads_files_without_it() -> None:
    plan = DynamicMig("GPU-1", 19, 3, 103, 0)
    device = CheckpointedDevice(("mig",), NODE, FREE_1G, ("id",), uuid="MIG-1", dynamic_mig=plan)
    intent = CheckpointedDevice(("mig",), NODE, FREE_3G, ("id",), dynamic_mig=DynamicMig("GPU-1", 9, 4))
    entry = ClaimEntry("u", "ns", "n", ClaimState.STARTED, (device, intent))
    raw = encode_record("boot", entry)
    assert json.loads(raw)["version"] == 2
    assert decode_record(raw) == ("boot", entry)
    plain = ClaimEntry("u", "ns", "n", ClaimState.COMPLETED, (CheckpointedDevice(("gpu",), NODE, "gpu-0", ("id",)),))
    assert "dynamicMig" not in encode_record("boot", plain).decode()  # records without created devices
    assert decode_record(encode_record("boot", plain))[1].devices[0].dynamic_mig is None


def test_a_second_spelling_of_a_created_mig_device_neither_shares_nor_destroys_it(node: Node) -> None:
    # Tried: a claim allocated `...-19-03`, the same placement as another claim's `...-19-3` with a leading zero.
    first, second = node.add("u1", [FREE_1G]), node.add("u2", ["gpu-2-mig-1g10gb-19-03"])
    preparer = node.preparer()
    ok(preparer.prepare([first])["u1"])
    refused = preparer.prepare([second])["u2"]
    assert "not a canonical device name" in refused.error and "gpu-2-mig-1g10gb-19-3" in refused.error
    assert preparer.unprepare([second]) == {"u2": ""}  # it holds nothing, so it destroys nothing
    assert node.migs.placements() == {(19, 3)}
    assert set(node.checkpoint().claims) == {"u1"}


def test_a_placement_on_a_hopper_gpu_in_mig_mode_off_switches_mig_on_and_back(node: Node) -> None:
    # GPU 3 (H100) is out of MIG mode: prepare turns it on (no reset needed), the last unprepare off again.
    gpu3 = node.inventory.gpu(3)
    assert gpu3 is not None and not gpu3.mig_enabled
    a, b = node.add("a", [MIG_OFF]), node.add("b", ["gpu-3-mig-1g10gb-19-1"])
    preparer = node.preparer()
    ok(preparer.prepare([a])["a"])
    assert node.migs.calls == [f"mig on {gpu3.uuid[:12]}", "create 19@0"]
    assert node.checkpoint().claims["a"].devices[0].mig_mode_switched
    ok(preparer.prepare([b])["b"])  # MIG mode is on by now: b creates only, and inherits the switch
    assert node.checkpoint().claims["b"].devices[0].mig_mode_switched
    assert preparer.unprepare([a]) == {"a": ""}
    assert node.migs.mig_on == {gpu3.uuid: True}  # b still needs it
    assert preparer.unprepare([b]) == {"b": ""}
    assert node.migs.mig_on == {gpu3.uuid: False} and node.migs.placements() == set()
    assert node.migs.calls[-2:] == ["destroy gi 101", f"mig off {gpu3.uuid[:12]}"]


def test_a_whole_hopper_gpu_in_mig_mode_without_instances_switches_mig_off_and_back(node: Node) -> None:
    gpu2 = node.inventory.gpu(2)  # MIG mode on, no instance
    assert gpu2 is not None and gpu2.mig_enabled
    preparer = node.preparer()
    ref = node.add("w", ["gpu-2"])
    [device] = ok(preparer.prepare([ref])["w"]).devices
    assert device.device_name == "gpu-2" and node.migs.calls == [f"mig off {gpu2.uuid[:12]}"]
    assert preparer.unprepare([ref]) == {"w": ""}
    assert node.migs.calls == [f"mig off {gpu2.uuid[:12]}", f"mig on {gpu2.uuid[:12]}"]
    assert node.checkpoint().claims == {}


def test_a_whole_gpu_with_mig_devices_is_refused(node: Node) -> None:
    error = node.preparer().prepare([node.add("w", ["gpu-0"])])["w"].error  # the operator's layout is on it
    assert "gpu-0 has MIG devices: it cannot run as a whole GPU" in error and node.migs.calls == []


def test_a_failed_mig_mode_switch_is_the_claims_error_and_leaves_nothing(node: Node) -> None:
    node.migs.mode_error = RuntimeError("the GPU is in use")
    result = node.preparer().prepare([node.add("a", [MIG_OFF])])["a"]
    assert "cannot turn MIG mode on on the GPU of gpu-3-mig-1g10gb-19-0: the GPU is in use" in result.error
    assert node.checkpoint().claims["a"].state is ClaimState.STARTED  # kept: switching back failed too
    node.migs.mode_error = None
    assert node.preparer().recover().rolled_back == ("a",)
    assert node.checkpoint().claims == {} and node.migs.placements() == set()
