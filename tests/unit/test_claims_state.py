"""The prepare/unprepare state machine, as the kubelet plugin sees it through ClaimPreparer."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import yaml

from agent.claims import cdi
from agent.claims.checkpoint import CheckpointStore, ClaimState
from agent.claims.lock import NodeLock
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef, PreparedDevice, PrepareResult
from agent.kubelet.dra import ClaimService
from tests.claim_sources import StaticClaimSource
from tests.unit.test_claims_support import DRIVER, NODE, claim, inventory, opaque

MIG0 = "gpu-4-mig-1g10gb-19-0"


class CountingSource(StaticClaimSource):
    def __init__(self) -> None:
        super().__init__()
        self.gets = 0

    def get(self, namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        self.gets += 1
        return super().get(namespace, name, timeout)


@dataclass
class Node:
    root: pathlib.Path
    source: CountingSource = field(default_factory=CountingSource)
    unhealthy: set[str] = field(default_factory=set)
    boot: str = "boot-1"
    dev_root: pathlib.Path | None = None

    @property
    def state_dir(self) -> pathlib.Path:
        return self.root / "state"

    @property
    def cdi_root(self) -> pathlib.Path:
        return self.root / "cdi"

    def preparer(self) -> ClaimPreparer:
        return ClaimPreparer(
            PrepareSettings(
                node_name=NODE,
                driver_name=DRIVER,
                inventory=inventory,
                is_healthy=lambda name: name not in self.unhealthy,
                mig_caps=cdi.MigCaps(lambda: None),
                dev_root=self.dev_root,
            ),
            state_dir=self.state_dir,
            cdi_root=self.cdi_root,
            source=self.source,
            boot_id=lambda: self.boot,
            lock_timeout=0.2,
        )

    def add(self, body: dict[str, Any]) -> ClaimRef:
        self.source.put(body)
        meta = body["metadata"]
        return ClaimRef(meta["namespace"], meta["uid"], meta["name"])

    def spec_files(self) -> set[str]:
        return {p.name for p in self.cdi_root.iterdir()} if self.cdi_root.exists() else set()

    def checkpoint(self) -> dict[str, ClaimState]:
        cp = CheckpointStore(self.state_dir, lambda: self.boot).load()
        return {uid: e.state for uid, e in cp.claims.items()}


@pytest.fixture
def node(tmp_path: pathlib.Path) -> Node:
    return Node(tmp_path)


def ok(result: PrepareResult) -> tuple[PreparedDevice, ...]:
    assert result.error == ""
    return result.devices


def test_prepare_a_gpu(node: Node, shared_dir: pathlib.Path) -> None:
    from tests.unit.test_claims_support import cdi_validator

    ref = node.add(claim("uid-1", ["gpu-0", "gpu-2"], request="train"))
    result = node.preparer().prepare([ref])
    assert ok(result["uid-1"]) == (
        PreparedDevice(("train",), NODE, "gpu-0", ("k8s.gpu.nvidia.com/claim=uid-1-gpu-0",)),
        PreparedDevice(("train",), NODE, "gpu-2", ("k8s.gpu.nvidia.com/claim=uid-1-gpu-2",)),
    )
    assert node.spec_files() == {"k8s.gpu.nvidia.com-claim_uid-1.json"}
    spec = yaml.safe_load((node.cdi_root / "k8s.gpu.nvidia.com-claim_uid-1.json").read_text())
    assert cdi_validator(shared_dir).is_valid(spec)
    assert [d["name"] for d in spec["devices"]] == ["uid-1-gpu-0", "uid-1-gpu-2"]
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED}


def test_prepare_a_mig_device_adds_its_capability_nodes(node: Node) -> None:
    ref = node.add(claim("uid-m", [MIG0], request="mig"))
    [device] = ok(node.preparer().prepare([ref])["uid-m"])
    assert device.device_name == MIG0
    spec = yaml.safe_load((node.cdi_root / "k8s.gpu.nvidia.com-claim_uid-m.json").read_text())
    nodes = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    gi, ci = cdi.default_mig_minor(4, 9), cdi.default_mig_minor(4, 9, 0)
    assert nodes == ["/dev/nvidia4", f"/dev/nvidia-caps/nvidia-cap{gi}", f"/dev/nvidia-caps/nvidia-cap{ci}"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]


def test_a_dev_root_puts_every_node_of_the_spec_beneath_it(node: Node) -> None:
    # --dev-root: a claim prepared after a restart (spec rewritten from the checkpoint) keeps it too.
    node.dev_root = node.root / "devroot"
    ref = node.add(claim("uid-d", [MIG0], request="mig"))
    ok(node.preparer().prepare([ref])["uid-d"])
    path = node.cdi_root / "k8s.gpu.nvidia.com-claim_uid-d.json"
    first = yaml.safe_load(path.read_text())
    nodes = [*first["containerEdits"]["deviceNodes"], *first["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes and all(n["hostPath"] == f"{node.dev_root}{n['path']}" for n in nodes)
    path.unlink()
    ok(node.preparer().prepare([ref])["uid-d"])
    assert yaml.safe_load(path.read_text()) == first


def test_prepare_is_idempotent(node: Node) -> None:
    ref = node.add(claim("uid-1"))
    preparer = node.preparer()
    first = preparer.prepare([ref])
    second = preparer.prepare([ref])
    assert second == first and ok(first["uid-1"])
    assert node.source.gets == 1  # a completed claim is answered from the checkpoint
    assert node.preparer().prepare([ref]) == first  # also after a restart


def test_a_completed_claim_whose_spec_vanished_gets_it_back(node: Node) -> None:
    ref = node.add(claim("uid-1"))
    preparer = node.preparer()
    first = preparer.prepare([ref])
    (node.cdi_root / "k8s.gpu.nvidia.com-claim_uid-1.json").unlink()
    assert preparer.prepare([ref]) == first
    assert node.spec_files() == {"k8s.gpu.nvidia.com-claim_uid-1.json"}


def crash_before_completed(monkeypatch: pytest.MonkeyPatch, preparer: ClaimPreparer) -> list[dict[str, ClaimState]]:
    """The next prepare dies at its Completed save (the last save of the batch; any before it happen): returns
    the states each save was asked to write."""
    store = preparer.states.checkpoints
    real_save = store.save
    asked: list[dict[str, ClaimState]] = []

    def save(cp: Any) -> None:
        asked.append({uid: e.state for uid, e in cp.claims.items()})
        if any(state is ClaimState.COMPLETED and uid not in store.load().claims for uid, state in asked[-1].items()):
            raise RuntimeError("killed before PrepareCompleted")
        real_save(cp)

    monkeypatch.setattr(store, "save", save)
    return asked


def left_started(node: Node, uid: str) -> None:
    """Turn the claim's Completed record into a Started one, as a crash of a prepare that saved its Started
    record (a claim creating MIG devices, or an agent before issue 37) leaves it."""
    store = CheckpointStore(node.state_dir, lambda: node.boot)
    cp = store.load()
    cp.claims[uid] = replace(cp.claims[uid], state=ClaimState.STARTED)
    store.save(cp)


def test_a_started_claim_is_rolled_back_and_redone(node: Node) -> None:
    ref = node.add(claim("uid-1"))
    preparer = node.preparer()
    assert ok(preparer.prepare([ref])["uid-1"])
    left_started(node, "uid-1")
    assert node.checkpoint() == {"uid-1": ClaimState.STARTED}
    assert ok(node.preparer().prepare([ref])["uid-1"])
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED}
    assert node.spec_files() == {"k8s.gpu.nvidia.com-claim_uid-1.json"}


def test_a_claim_whose_spec_is_its_only_side_effect_is_saved_once(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    # Tried: a plain 1-GPU prepare, counting checkpoint saves; then a crash at that save. Before issue 37 the
    # prepare saved a PrepareStarted record first (two fsyncs more) that protected nothing a spec-only claim has.
    ref = node.add(claim("uid-1"))
    preparer = node.preparer()
    asked = crash_before_completed(monkeypatch, preparer)
    assert "killed before PrepareCompleted" in preparer.prepare([ref])["uid-1"].error
    assert asked == [{"uid-1": ClaimState.COMPLETED}]  # no Started record was written
    monkeypatch.undo()
    # What the crash leaves: a spec no record owns, which the kubelet never named to a runtime (the prepare
    # failed) and which recovery removes; the retry prepares the claim as if nothing had happened.
    assert node.checkpoint() == {} and node.spec_files() == {cdi.spec_file_name("uid-1")}
    assert node.preparer().recover().removed_specs == ("uid-1",)
    assert node.spec_files() == set()
    assert ok(node.preparer().prepare([ref])["uid-1"])
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED}


class RecordingSharing:
    """A ClaimSharing stand-in that notes which records are on disk when a claim's sharing is applied."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.on_disk_at_apply: dict[str, ClaimState] = {}

    def apply(self, uid: str, devices: Any, configs: Any, inventory: Any, spec: Any) -> Any:
        self.on_disk_at_apply = self.node.checkpoint()
        return spec

    def undo(self, uid: str) -> None:
        pass


def test_a_claim_applying_sharing_has_its_started_record_on_disk_first(node: Node) -> None:
    # Tried: a TimeSlicing claim on an agent that applies sharing; the sharing is a side effect beyond the spec,
    # so its Started record must be durable before it (recovery undoes what the record names).
    sharing = RecordingSharing(node)
    preparer = node.preparer()
    preparer.states.sharing = sharing  # type: ignore[assignment]
    ref = node.add(claim("ts", ["gpu-0"], configs=[opaque(sharing={"strategy": "TimeSlicing"})]))
    assert ok(preparer.prepare([ref])["ts"])
    assert sharing.on_disk_at_apply == {"ts": ClaimState.STARTED}
    assert node.checkpoint() == {"ts": ClaimState.COMPLETED}


def test_an_older_agents_yaml_spec_is_kept_by_recovery_and_removed_at_unprepare(node: Node) -> None:
    # Tried: the upgrade from an agent that wrote YAML specs, with one claim prepared by it and a stray spec it
    # leaked. Before issue 37's fix, the new agent looked only for its own name: recovery would write a second
    # spec beside the old one (CDI refuses a device two files define) and unprepare would leave the old one.
    prepared, leaked = node.add(claim("old")), node.add(claim("leaked-old", ["gpu-1"]))
    ok(node.preparer().prepare([prepared])["old"])
    json_spec = node.cdi_root / cdi.spec_file_name("old")
    yaml_spec = json_spec.with_suffix(".yaml")
    yaml_spec.write_text(yaml.safe_dump(json.loads(json_spec.read_text()), sort_keys=False))  # as the old agent
    json_spec.unlink()
    (node.cdi_root / "k8s.gpu.nvidia.com-claim_leaked-old.yaml").write_text("cdiVersion: 0.3.0\n")
    recovery = node.preparer().recover()  # the new agent starts
    assert recovery.restored_specs == () and recovery.removed_specs == ("leaked-old",)
    assert node.spec_files() == {yaml_spec.name}
    assert ok(node.preparer().prepare([prepared])["old"])  # the kubelet's re-prepare: the old spec serves
    assert node.spec_files() == {yaml_spec.name}
    assert node.preparer().unprepare([prepared, leaked]) == {"old": "", "leaked-old": ""}
    assert node.spec_files() == set() and node.checkpoint() == {}


def test_a_failed_prepare_leaves_nothing_behind(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    ref, other = node.add(claim("uid-1")), node.add(claim("uid-2", ["gpu-1"]))
    preparer = node.preparer()

    def full_disk(*args: Any) -> None:
        raise OSError("No space left on device")

    monkeypatch.setattr(preparer.states.specs, "write", full_disk)
    assert "cannot write CDI spec: No space left" in preparer.prepare([ref])["uid-1"].error
    assert node.checkpoint() == {}
    assert node.spec_files() == set()
    monkeypatch.undo()
    # later claims of a batch still prepare when one spec write fails
    real_write = preparer.states.specs.write

    def fail_first(uid: str, spec: Any) -> Any:
        if uid == "uid-1":
            raise OSError("No space left on device")
        return real_write(uid, spec)

    monkeypatch.setattr(preparer.states.specs, "write", fail_first)
    results = preparer.prepare([ref, other])
    assert results["uid-1"].error and ok(results["uid-2"])
    assert node.checkpoint() == {"uid-2": ClaimState.COMPLETED}
    assert node.spec_files() == {"k8s.gpu.nvidia.com-claim_uid-2.json"}


def test_unprepare_removes_spec_and_entry(node: Node) -> None:
    ref = node.add(claim("uid-1"))
    preparer = node.preparer()
    ok(preparer.prepare([ref])["uid-1"])
    assert preparer.unprepare([ref]) == {"uid-1": ""}
    assert node.spec_files() == set()
    assert node.checkpoint() == {}
    assert preparer.unprepare([ref]) == {"uid-1": ""}  # twice is fine


def test_unprepare_of_an_unknown_claim_succeeds(node: Node) -> None:
    assert node.preparer().unprepare([ClaimRef("default", "never-seen", "gone")]) == {"never-seen": ""}


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (claim("other-uid", name="c"), "has UID other-uid, not uid-1: the claim was deleted and recreated"),
        (claim("uid-1", name="c", allocated=False), "ResourceClaim default/c is not allocated"),
        (claim("uid-1", name="c", driver="net.example.com"), "no device of driver gpu.nvidia.com in pool node-a"),
        (claim("uid-1", name="c", pool="node-b"), r"\(it was allocated gpu.nvidia.com/node-b/gpu-0\)"),
        (claim("uid-1", ["gpu-9"], name="c"), "device gpu-9 does not exist on node node-a"),
        (claim("uid-1", ["gpu-4"], name="c"), "gpu-4 has MIG mode enabled"),
        (claim("uid-1", ["gpu-4-mig-2g20gb-14-0"], name="c"), "MIG device gpu-4-mig-2g20gb-14-0 does not exist"),
        (claim("uid-1", ["nic-0"], name="c"), "'nic-0' is not a device name of this driver"),
        (
            claim("uid-1", [MIG0], name="c", configs=[opaque("GpuConfig", ["gpu"], sharing={"strategy": "MPS"})]),
            "is a mig device: it takes MigDeviceConfig, not GpuConfig",
        ),
        (
            claim("uid-1", name="c", configs=[opaque(sharing={"strategy": "TimeSlicing", "extra": True})]),
            r"bad device config: config\[0\] \(FromClaim\): sharing: unknown field",
        ),
    ],
)
def test_claims_that_cannot_be_prepared(node: Node, body: dict[str, Any], error: str) -> None:
    node.source.put(body)
    result = node.preparer().prepare([ClaimRef("default", "uid-1", "c")])["uid-1"]
    assert result.devices == ()
    assert result.error
    import re

    assert re.search(error, result.error), result.error
    assert node.spec_files() == set() and node.checkpoint() == {}


def test_claim_missing_from_the_api(node: Node) -> None:
    result = node.preparer().prepare([ClaimRef("default", "uid-1", "nope")])["uid-1"]
    assert "cannot read ResourceClaim default/nope" in result.error


def test_only_this_driver_and_pool_results_are_prepared(node: Node) -> None:
    body = claim(
        "uid-1",
        ["gpu-1"],
        extra_results=[
            {"request": "gpu", "driver": DRIVER, "pool": "node-b", "device": "gpu-0"},
            {"request": "nic", "driver": "net.example.com", "pool": NODE, "device": "eth0"},
        ],
    )
    [device] = ok(node.preparer().prepare([node.add(body)])["uid-1"])
    assert device.device_name == "gpu-1"


def test_unhealthy_device_is_refused(node: Node) -> None:
    node.unhealthy.add("gpu-1")
    result = node.preparer().prepare([node.add(claim("uid-1", ["gpu-1"]))])["uid-1"]
    assert result.error == "device gpu-1 is unhealthy"


def test_device_prepared_for_another_claim_is_refused(node: Node) -> None:
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1", ["gpu-0"]))])["uid-1"])
    result = preparer.prepare([node.add(claim("uid-2", ["gpu-0"], name="second"))])["uid-2"]
    assert result.error == (
        "device gpu-0 is already prepared for ResourceClaim default/claim-uid-1 (uid uid-1); "
        "claims share a device only with a TimeSlicing or MPS config in both"
    )
    # once the first claim is gone the device is free again
    preparer.unprepare([ClaimRef("default", "uid-1", "claim-uid-1")])
    assert ok(preparer.prepare([ClaimRef("default", "uid-2", "second")])["uid-2"])


def test_sharing_configs_let_claims_share_a_device(node: Node) -> None:
    shared = [opaque(sharing={"strategy": "TimeSlicing"})]
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1", configs=shared))])["uid-1"])
    ok(preparer.prepare([node.add(claim("uid-2", configs=shared))])["uid-2"])
    mps = [opaque(sharing={"strategy": "MPS"})]
    result = preparer.prepare([node.add(claim("uid-3", configs=mps))])["uid-3"]
    assert "already prepared" in result.error  # MPS cannot join time-sliced claims
    result = preparer.prepare([node.add(claim("uid-4"))])["uid-4"]
    assert "its sharing (TimeSlicing) differs from this claim's (none)" in result.error


def test_admin_access_does_not_take_the_device(node: Node) -> None:
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1"))])["uid-1"])
    admin = claim("uid-2", [])
    admin["status"]["allocation"]["devices"]["results"] = [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0", "adminAccess": True}
    ]
    ok(preparer.prepare([node.add(admin)])["uid-2"])


def test_two_claims_of_one_batch_cannot_take_the_same_device(node: Node) -> None:
    a, b = node.add(claim("uid-1", ["gpu-0"])), node.add(claim("uid-2", ["gpu-0"]))
    results = node.preparer().prepare([a, b])
    assert ok(results["uid-1"])
    assert "device gpu-0 is already prepared for ResourceClaim default/claim-uid-1" in results["uid-2"].error
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED}


def test_one_bad_claim_does_not_fail_the_batch(node: Node) -> None:
    good1 = node.add(claim("uid-1", ["gpu-0"]))
    bad = node.add(claim("uid-2", ["gpu-9"]))
    good2 = node.add(claim("uid-3", ["gpu-1"]))
    missing = ClaimRef("default", "uid-4", "missing")
    results = node.preparer().prepare([good1, bad, good2, missing])
    assert set(results) == {"uid-1", "uid-2", "uid-3", "uid-4"}
    assert ok(results["uid-1"]) and ok(results["uid-3"])
    assert results["uid-2"].error and results["uid-4"].error
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED, "uid-3": ClaimState.COMPLETED}


def test_an_unexpected_error_stays_in_its_claim(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = node.add(claim("uid-1", ["gpu-0"])), node.add(claim("uid-2", ["gpu-1"]))
    preparer = node.preparer()
    real_get = node.source.get

    def flaky(namespace: str, name: str, timeout: float | None = None) -> Mapping[str, Any]:
        if name == "claim-uid-1":
            raise ConnectionResetError("connection reset by peer")
        return real_get(namespace, name, timeout)

    monkeypatch.setattr(node.source, "get", flaky)
    results = preparer.prepare([a, b])
    assert "connection reset by peer" in results["uid-1"].error
    assert ok(results["uid-2"])


def test_a_reboot_voids_old_claims_and_their_specs(node: Node) -> None:
    ok(node.preparer().prepare([node.add(claim("uid-1"))])["uid-1"])
    node.boot = "boot-2"
    preparer = node.preparer()
    assert preparer.recover().removed_specs == ()  # voided on load, before the leak scan
    assert node.spec_files() == set()
    assert node.checkpoint() == {}
    # the kubelet prepares it again in the new boot
    assert ok(preparer.prepare([ClaimRef("default", "uid-1", "claim-uid-1")])["uid-1"])


def test_recover_repairs_every_kind_of_leftover(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("done", ["gpu-0"]))])["done"])
    ok(preparer.prepare([node.add(claim("lost-spec", ["gpu-1"]))])["lost-spec"])
    (node.cdi_root / "k8s.gpu.nvidia.com-claim_lost-spec.json").unlink()
    # a Started claim with its spec written (crash before Completed)
    ok(preparer.prepare([node.add(claim("half", ["gpu-2"]))])["half"])
    left_started(node, "half")
    # a crash before Completed of a claim whose spec is its only side effect: a spec and no record
    crash_before_completed(monkeypatch, preparer)
    assert preparer.prepare([node.add(claim("no-record", ["gpu-3"]))])["no-record"].error
    monkeypatch.undo()
    # leaked specs with no claim (one an older agent's YAML), a temp file from a torn write, another vendor's spec
    (node.cdi_root / "k8s.gpu.nvidia.com-claim_leaked.yaml").write_text("cdiVersion: 0.3.0\n")
    (node.cdi_root / "k8s.gpu.nvidia.com-claim_x.json.abc.tmp").write_text("")
    (node.state_dir / "checkpoint.json.abc.tmp").write_text("")
    (node.cdi_root / "vendor-gpu.yaml").write_text("")
    assert node.checkpoint() == {
        "done": ClaimState.COMPLETED,
        "lost-spec": ClaimState.COMPLETED,
        "half": ClaimState.STARTED,
    }

    recovery = node.preparer().recover()
    assert recovery.rolled_back == ("half",)
    assert recovery.restored_specs == ("lost-spec",)
    assert recovery.removed_specs == ("leaked", "no-record")
    assert recovery.removed_temps == 2
    assert node.spec_files() == {
        "k8s.gpu.nvidia.com-claim_done.json",
        "k8s.gpu.nvidia.com-claim_lost-spec.json",
        "vendor-gpu.yaml",
    }
    assert node.checkpoint() == {"done": ClaimState.COMPLETED, "lost-spec": ClaimState.COMPLETED}
    assert node.preparer().recover() == type(recovery)()  # nothing left to repair


def test_a_corrupt_record_fences_its_claim_alone_and_keeps_its_devices_held(node: Node) -> None:
    # Tried: one prepared claim's record damaged (a flipped byte), then prepares and unprepares of it and of
    # others. Before, every prepare and unprepare on the node failed with the checksum error.
    ok(node.preparer().prepare([node.add(claim("uid-1"))])["uid-1"])  # gpu-0
    ok(node.preparer().prepare([node.add(claim("uid-3", ["gpu-2"]))])["uid-3"])
    path = node.state_dir / "claims" / "uid-1.json"
    damaged = path.read_bytes().replace(b"gpu-0", b"gpu-7")  # the salvaged device name is the damaged one
    damaged = damaged.replace(b'"gpu-7","cdiDeviceIDs"', b'"gpu-0","cdiDeviceIDs"')  # only the id is hit
    path.write_bytes(damaged)
    told: list[tuple[Any, ...]] = []
    fenced: list[int] = []
    preparer = node.preparer()
    preparer.notify = lambda *event: told.append(event)
    preparer.on_fenced = fenced.append
    one = ClaimRef("default", "uid-1", "claim-uid-1")
    results = preparer.prepare([one, node.add(claim("uid-2", ["gpu-1"])), node.add(claim("uid-4", ["gpu-0"]))])
    assert f"{path}: checksum mismatch" in results["uid-1"].error
    assert "move it aside to reset (the kubelet prepares its claims again)" in results["uid-1"].error
    assert "(it holds gpu-0); the claim is fenced until then" in results["uid-1"].error
    ok(results["uid-2"])  # other claims go on
    assert results["uid-4"].error.startswith("device gpu-0 stays held: the checkpoint record of claim uid-1 cannot")
    errors = preparer.unprepare([one, ClaimRef("default", "uid-3", "claim-uid-3")])
    assert (
        errors["uid-3"] == ""
        and "checksum mismatch" in errors["uid-1"]
        and "not unprepared until then" in (errors["uid-1"])
    )
    assert cdi.spec_file_name("uid-1") in node.spec_files()  # its containers may still need it
    preparer.recover()  # a restart keeps it too
    assert cdi.spec_file_name("uid-1") in node.spec_files()
    assert path.read_bytes() == damaged  # evidence kept; the prepared claim not forgotten
    assert [(t[0], t[1], t[2]) for t in told] == [(None, "Warning", "ClaimRecordFenced")]  # told once, on the Node
    assert "cannot be trusted" in told[0][3] and fenced[-1] == 1
    path.rename(node.root / "aside.json")  # the remedy: the kubelet's retries go through
    assert preparer.unprepare([one]) == {"uid-1": ""}
    assert cdi.spec_file_name("uid-1") not in node.spec_files()
    ok(preparer.prepare([ClaimRef("default", "uid-4", "claim-uid-4")])["uid-4"])
    assert fenced[-1] == 0


def test_an_unreadable_record_holds_the_devices_its_spec_names(node: Node) -> None:
    # Tried: a prepared claim's record overwritten with garbage (nothing in it names a device). Its CDI spec
    # still names them, and a share keeps its shareID out of the device name.
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1", ["gpu-0", MIG0]))])["uid-1"])
    (node.state_dir / "claims" / "uid-1.json").write_bytes(b"\x00garbage")
    assert sorted(d for d, _ in node.preparer().holders()) == ["gpu-0", MIG0]
    assert (
        node.preparer()
        .prepare([node.add(claim("uid-2", [MIG0]))])["uid-2"]
        .error.startswith(f"device {MIG0} stays held")
    )
    assert cdi.device_names({"devices": [{"name": "u-gpu-3-0b7c1a9e-1f2d-4c3b-9a8e-7d6c5b4a3f21"}]}, "u") == ("gpu-3",)


@pytest.mark.parametrize("content", [b"\x00garbage", b"{}"], ids=["not-json", "no-data"])
def test_a_stray_unreadable_record_fences_only_its_name(node: Node, content: bytes) -> None:
    preparer = node.preparer()
    (node.state_dir / "claims").mkdir(parents=True, exist_ok=True)
    (node.state_dir / "claims" / "stray.json").write_bytes(content)
    ok(preparer.prepare([node.add(claim("uid-1"))])["uid-1"])  # the devices it holds cannot be read: none held
    error = preparer.prepare([node.add(claim("stray", ["gpu-1"]))])["stray"].error
    assert "stray.json" in error and "the devices it holds cannot be read" in error
    assert preparer.unprepare([ClaimRef("default", "uid-1", "claim-uid-1")]) == {"uid-1": ""}
    assert node.preparer().holders() == []


def _hold_lock(path: str, ready: Any, release: Any) -> None:
    with NodeLock(pathlib.Path(path)).hold():
        ready.set()
        release.wait(10)


def test_prepare_waits_for_the_node_lock_and_gives_up(node: Node) -> None:
    preparer = node.preparer()  # creates the state dir
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(node.state_dir / "pu.lock"), ready, release))
    holder.start()
    try:
        assert ready.wait(10)
        ref = node.add(claim("uid-1"))
        assert "held by another process" in preparer.prepare([ref])["uid-1"].error
        assert "held by another process" in preparer.unprepare([ref])["uid-1"]
    finally:
        release.set()
        holder.join(10)
    assert ok(preparer.prepare([ref])["uid-1"])


def test_empty_batches(node: Node) -> None:
    assert node.preparer().prepare([]) == {}
    assert node.preparer().unprepare([]) == {}


def test_prepared_lists_devices_in_use(node: Node) -> None:
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1", ["gpu-0", MIG0]))])["uid-1"])
    assert sorted(device for device, _ in preparer.holders()) == ["gpu-0", MIG0]


def test_each_claim_has_a_json_record_with_the_boot_id(node: Node) -> None:
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1"))])["uid-1"])
    ok(preparer.prepare([node.add(claim("uid-2", ["gpu-1"]))])["uid-2"])
    assert sorted(p.name for p in (node.state_dir / "claims").iterdir()) == ["uid-1.json", "uid-2.json"]
    doc = json.loads((node.state_dir / "claims" / "uid-1.json").read_text())
    assert doc["version"] == 2
    assert doc["data"]["nodeBootID"] == "boot-1"
    assert doc["data"]["uid"] == "uid-1" and doc["data"]["state"] == "PrepareCompleted"
    assert preparer.unprepare([ClaimRef("default", "uid-1", "claim-uid-1")]) == {"uid-1": ""}
    assert [p.name for p in (node.state_dir / "claims").iterdir()] == ["uid-2.json"]


@pytest.mark.parametrize("spelling", ["gpu-01", "gpu-001", "gpu-1\n"])
def test_a_gpu_is_prepared_only_under_the_name_the_agent_publishes(node: Node, spelling: str) -> None:
    # Tried: the same GPU under another spelling, which a string comparison takes for a free device.
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1", ["gpu-1"]))])["uid-1"])
    result = preparer.prepare([node.add(claim("uid-2", [spelling]))])["uid-2"]
    assert result.error and "device name" in result.error and result.devices == ()
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED}


def test_an_unhealthy_gpu_is_refused_whatever_the_spelling(node: Node) -> None:
    node.unhealthy.add("gpu-2")
    result = node.preparer().prepare([node.add(claim("uid-1", ["gpu-02"]))])["uid-1"]
    assert "not a canonical device name" in result.error


@pytest.mark.parametrize(
    "bad_uid",
    ["x/../y", "../../etc/passwd", "a\0b", "u" * 256, ".", "..", "-lead", "sp ace", "uid\n"],
)
def test_a_bad_uid_is_that_claims_error_and_touches_no_path(node: Node, tmp_path: pathlib.Path, bad_uid: str) -> None:
    # Tried: UIDs that are paths, NUL bytes, over-long: each would name a file outside the CDI root or fail
    # the file system call, and so the whole batch. The kubelet edge screens them (ClaimService), once.
    outside = tmp_path / "y.yaml"
    outside.write_text("precious")
    (node.cdi_root).mkdir(parents=True)
    (node.cdi_root.parent / "y.yaml").write_text("precious")
    service = ClaimService(node.preparer())
    good = node.add(claim("uid-good", ["gpu-0"]))
    bad = ClaimRef("default", bad_uid, "claim-bad")
    results = service.prepare([bad, good])
    assert "claim UID" in results[bad_uid].error and results[bad_uid].devices == ()
    ok(results["uid-good"])
    refused = results[bad_uid].error.removeprefix("prepare: ")
    assert service.unprepare([bad, good]) == {bad_uid: f"unprepare: {refused}", "uid-good": ""}
    assert outside.read_text() == "precious" and (node.cdi_root.parent / "y.yaml").read_text() == "precious"
    assert node.checkpoint() == {}


@pytest.mark.parametrize(
    ("namespace", "name", "why"),
    [
        ("", "c", "lacks namespace"),
        ("Default", "c", "namespace"),
        ("a/b", "c", "namespace"),
        ("default", "../c", "not a ResourceClaim name"),
        ("default", "c" * 254, "not a ResourceClaim name"),
    ],
)
def test_names_the_api_would_refuse_are_refused_before_any_request(
    node: Node, namespace: str, name: str, why: str
) -> None:
    result = ClaimService(node.preparer()).prepare([ClaimRef(namespace, "uid-x", name)])["uid-x"]
    assert why in result.error
    assert node.source.gets == 0


def test_each_refused_claim_is_logged_once_at_warning_with_its_reason(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused at the kubelet edge (a bad UID) or by the node (a device it lacks): one line each, alike."""
    refs = [node.add(claim("uid-1", ["gpu-9"])), ClaimRef("default", "x/../y", "c"), node.add(claim("uid-2"))]
    with caplog.at_level("INFO"):
        results = ClaimService(node.preparer()).prepare(refs)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert sorted(r.getMessage() for r in refusals) == sorted(
        [
            f"prepare of claim default/claim-uid-1 refused: {results['uid-1'].error}",
            f"prepare of claim default/c refused: {results['x/../y'].error.removeprefix('prepare: ')}",
        ]
    )
    assert {r.levelname for r in refusals} == {"WARNING"}
    assert "gpu-9 does not exist" in results["uid-1"].error and results["uid-2"].error == ""


@pytest.mark.parametrize(
    "mps",
    [
        {"defaultPerDevicePinnedMemoryLimit": {"\u00b2": "1Gi"}},  # a digit to str.isdigit(), not to int()
        {"defaultPerDevicePinnedMemoryLimit": {"\u0661": "1Gi"}},  # an Arabic-Indic one
        {"defaultPerDevicePinnedMemoryLimit": {"1" * 5000: "1Gi"}},
        {"defaultPinnedDeviceMemoryLimit": "1" * 5000},
        {"defaultPinnedDeviceMemoryLimit": 10**5000},
        {"defaultPerDevicePinnedMemoryLimit": {"0": "9" * 5000 + "Gi"}},
    ],
    ids=["superscript-key", "arabic-key", "long-key", "5000-digits", "huge-int", "5000-digit-limit"],
)
def test_a_malformed_mps_config_is_a_bad_device_config(node: Node, mps: dict[str, Any]) -> None:
    configs = [opaque(sharing={"strategy": "MPS", "mpsConfig": mps})]
    bad, good = node.add(claim("uid-1", ["gpu-0", "gpu-1"], configs=configs)), node.add(claim("uid-2", ["gpu-2"]))
    results = node.preparer().prepare([bad, good])
    assert "bad device config" in results["uid-1"].error and "internal error" not in results["uid-1"].error
    assert len(results["uid-1"].error) < 400  # the 5000 digits are not echoed back
    ok(results["uid-2"])


@pytest.mark.parametrize(
    "config",
    [["not an object"], [{**opaque(), "requests": 5}], [{**opaque(), "requests": [1]}]],
)
def test_a_malformed_config_list_is_a_bad_device_config(node: Node, config: list[Any]) -> None:
    body = claim("uid-1")
    body["status"]["allocation"]["devices"]["config"] = config
    result = node.preparer().prepare([node.add(body)])["uid-1"]
    assert "bad device config" in result.error


def test_a_config_naming_a_request_the_claim_lacks_is_that_claims_error(node: Node) -> None:
    """Tried: an MPS config for request "gpus" in a claim whose request is "gpu"; the device would have been
    prepared exclusive, the config silently dropped. The other claim of the batch is prepared."""
    configs = [opaque(requests=["gpus"], sharing={"strategy": "MPS"})]
    bad, good = node.add(claim("uid-1", ["gpu-0"], configs=configs)), node.add(claim("uid-2", ["gpu-1"]))
    results = node.preparer().prepare([bad, good])
    assert results["uid-1"].error == (
        "ResourceClaim default/claim-uid-1: bad device config: config[0] names request 'gpus', which the claim "
        "does not have (its requests: gpu)"
    )
    ok(results["uid-2"])
    assert node.checkpoint() == {"uid-2": ClaimState.COMPLETED}


def test_configs_may_name_a_prioritized_list_request_or_its_subrequest(node: Node) -> None:
    for uid, named in (("uid-1", "gpu"), ("uid-2", "gpu/large")):
        body = claim(
            uid,
            [f"gpu-{uid[-1]}"],
            request="gpu/large",
            configs=[opaque(requests=[named], sharing={"strategy": "TimeSlicing"})],
        )
        body["spec"]["devices"]["requests"] = [
            {
                "name": "gpu",
                "firstAvailable": [
                    {"name": "large", "deviceClassName": "gpu.nvidia.com"},
                    {"name": "small", "deviceClassName": "mig.nvidia.com"},
                ],
            }
        ]
        ok(node.preparer().prepare([node.add(body)])[uid])


def test_a_claim_wide_mig_config_on_whole_gpus_is_that_claims_error(node: Node) -> None:
    configs = [opaque("MigDeviceConfig", sharing={"strategy": "MPS"})]
    result = node.preparer().prepare([node.add(claim("uid-1", ["gpu-0", "gpu-1"], configs=configs))])["uid-1"]
    assert result.error == (
        "ResourceClaim default/claim-uid-1: bad device config: the FromClaim MigDeviceConfig for every request "
        "configures no device: the claim's devices (gpu-0, gpu-1) take GpuConfig"
    )
    assert node.checkpoint() == {}


def test_a_prepare_naming_another_claim_for_a_stored_uid_is_refused(node: Node) -> None:
    """The UID is prepared as default/claim-uid-1; a request for it under another name (or namespace) gets no
    devices, and the stored claim stays prepared."""
    preparer = node.preparer()
    ok(preparer.prepare([node.add(claim("uid-1", ["gpu-0"]))])["uid-1"])
    for ref in (ClaimRef("default", "uid-1", "someone-else"), ClaimRef("other", "uid-1", "claim-uid-1")):
        result = preparer.prepare([ref])["uid-1"]
        assert result.devices == ()
        assert result.error == (
            f"claim UID uid-1 is prepared here as ResourceClaim default/claim-uid-1, not "
            f"{ref.namespace}/{ref.name}: refused"
        )
    assert node.checkpoint() == {"uid-1": ClaimState.COMPLETED}
    ok(preparer.prepare([ClaimRef("default", "uid-1", "claim-uid-1")])["uid-1"])


class TurnsReadOnly(cdi.CdiStore):
    """A CDI root that turns read-only after `writable` spec writes: writes, and removals of existing
    files, fail with EROFS as the kernel's would (a missing file is still ENOENT)."""

    def __init__(self, root: pathlib.Path, writable: int) -> None:
        super().__init__(root)
        self.writable = writable

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> pathlib.Path:
        if self.writable <= 0:
            raise OSError(30, "Read-only file system", str(self.path(claim_uid)))
        self.writable -= 1
        return super().write(claim_uid, spec)

    def remove(self, claim_uid: str) -> bool:
        if self.writable <= 0 and self.path(claim_uid).exists():
            raise OSError(30, "Read-only file system", str(self.path(claim_uid)))
        return super().remove(claim_uid)


def test_a_rollback_that_cannot_remove_the_spec_frees_the_claims_devices(node: Node) -> None:
    # Tried: the CDI root turns read-only after the first spec of a batch is written, while uid-b's spec from
    # an earlier attempt (the agent died after writing it) is still there, so its rollback cannot remove it.
    preparer = node.preparer()
    a, b = node.add(claim("uid-a", ["gpu-0"])), node.add(claim("uid-b", ["gpu-1"]))
    cdi.CdiStore(node.cdi_root).write("uid-b", {"left": "by a crash"})
    preparer.states.specs = readonly = TurnsReadOnly(node.cdi_root, writable=1)
    results = preparer.prepare([a, b])
    ok(results["uid-a"])  # the batch does not fail
    assert "cannot write CDI spec" in results["uid-b"].error and "Read-only file system" in results["uid-b"].error
    assert "cannot remove CDI spec" in results["uid-b"].error
    assert node.checkpoint() == {"uid-a": ClaimState.COMPLETED}  # uid-b rolled back, not left half-prepared
    readonly.writable = 1  # the root is writable again: gpu-1 is free for another claim
    ok(preparer.prepare([node.add(claim("uid-c", ["gpu-1"]))])["uid-c"])
    assert node.preparer().recover().removed_specs == ("uid-b",)  # the leftover goes at the next start


def test_an_unprepare_that_cannot_remove_the_spec_is_that_claims_error_and_is_retried(node: Node) -> None:
    preparer = node.preparer()
    a, b = node.add(claim("uid-a", ["gpu-0"])), node.add(claim("uid-b", ["gpu-1"]))
    assert not any(r.error for r in preparer.prepare([a, b]).values())
    (node.cdi_root / cdi.spec_file_name("uid-b")).unlink()  # b's spec is gone: nothing read-only to remove
    preparer.states.specs = readonly = TurnsReadOnly(node.cdi_root, writable=0)
    errors = preparer.unprepare([a, b])
    assert "Read-only file system" in errors["uid-a"] and errors["uid-b"] == ""
    assert node.checkpoint() == {}
    readonly.writable = 1
    assert preparer.unprepare([a]) == {"uid-a": ""}  # the kubelet's retry removes the spec
    assert node.spec_files() == set()


def test_a_directory_where_a_spec_file_belongs_is_skipped_with_a_warning(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    # Tried: a directory named like a claim's spec in the CDI root, at start-up and for that claim.
    stray = node.cdi_root / cdi.spec_file_name("uid-dir")
    (stray / "inside").mkdir(parents=True)
    with caplog.at_level("WARNING"):
        recovery = node.preparer().recover()
    assert recovery.removed_specs == () and stray.is_dir()
    assert [r.getMessage() for r in caplog.records] == [f"skipping {stray}: not a CDI spec file"]
    preparer = node.preparer()
    result = preparer.prepare([node.add(claim("uid-dir"))])["uid-dir"]
    assert "cannot write CDI spec" in result.error and node.checkpoint() == {}  # that claim's error only
    ok(preparer.prepare([node.add(claim("uid-2", ["gpu-1"]))])["uid-2"])
