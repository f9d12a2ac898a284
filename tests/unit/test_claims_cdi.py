"""Per-claim CDI specs: names, ids, contents, schema validity, minimum cdiVersion, files."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import pytest
import yaml

from agent.claims import cdi
from agent.claims.cdi import CdiDevice, CdiStore, MigCaps

UID = "a3c1e2f0-1111-2222-3333-444455556666"  # starts with a letter
DIGIT_UID = "7e57e2f0-1111-2222-3333-444455556666"  # starts with a digit


def gpu_spec(uid: str = UID) -> dict[str, Any]:
    devices = [
        CdiDevice("gpu-0", "GPU-0", cdi.gpu_device_nodes(0)),
        CdiDevice("gpu-3", "GPU-3", cdi.gpu_device_nodes(3)),
    ]
    return cdi.claim_spec(uid, devices, "node-a", "gpu.nvidia.com")


def test_file_name_and_device_id_follow_nvidia_conventions() -> None:
    assert cdi.spec_file_name(UID) == f"k8s.gpu.nvidia.com-claim_{UID}.json"
    assert cdi.device_id(UID, "gpu-0") == f"k8s.gpu.nvidia.com/claim={UID}-gpu-0"


def test_spec_contents() -> None:
    spec = gpu_spec()
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert [d["name"] for d in spec["devices"]] == [f"{UID}-gpu-0", f"{UID}-gpu-3"]
    assert spec["devices"][1]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia3"}]
    top = spec["containerEdits"]
    assert [n["path"] for n in top["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in top["env"]  # a legacy NVIDIA hook must not inject a second time
    assert "KUBERNETES_NODE_NAME=node-a" in top["env"]
    assert "DRA_RESOURCE_DRIVER_NAME=gpu.nvidia.com" in top["env"]


def test_a_spec_without_devices_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one device"):
        cdi.claim_spec(UID, [], "node-a", "gpu.nvidia.com")


@pytest.mark.parametrize("uid", [UID, DIGIT_UID])
def test_specs_validate_against_the_cdi_schema(shared_dir: pathlib.Path, uid: str) -> None:
    from tests.unit.test_claims_support import cdi_validator

    validator = cdi_validator(shared_dir)
    mig = CdiDevice("gpu-4-mig-1g10gb-19-0", "MIG-1", cdi.mig_device_nodes(4, 9, 0, MigCaps(lambda: None)))
    for spec in (gpu_spec(uid), cdi.claim_spec(uid, [mig], "node-a", "gpu.nvidia.com")):
        errors = [e.message for e in validator.iter_errors(spec)]
        assert errors == []


def test_a_dev_root_names_the_host_nodes_beneath_it(shared_dir: pathlib.Path) -> None:
    # Stand-in or relocated device nodes: the container still sees /dev/nvidia3, the runtime reads the host's.
    from tests.unit.test_claims_support import cdi_validator

    devices = [CdiDevice("gpu-3", "GPU-3", cdi.gpu_device_nodes(3))]
    spec = cdi.claim_spec(UID, devices, "node-a", "gpu.nvidia.com", pathlib.Path("/run/test-dev"))
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia3", "hostPath": "/run/test-dev/dev/nvidia3"}
    ]
    control = spec["containerEdits"]["deviceNodes"][0]
    assert control == {"path": "/dev/nvidiactl", "hostPath": "/run/test-dev/dev/nvidiactl"}
    assert spec["cdiVersion"] == "0.5.0"  # hostPath needs it
    assert cdi_validator(shared_dir).is_valid(spec)
    # `/` is the host's own /dev: no hostPath, the lowest version.
    plain = cdi.claim_spec(UID, devices, "node-a", "gpu.nvidia.com", pathlib.Path("/"))
    assert plain == cdi.claim_spec(UID, devices, "node-a", "gpu.nvidia.com")


def test_schema_check_catches_a_broken_spec(shared_dir: pathlib.Path) -> None:
    # The validator used above must be able to fail: a device without containerEdits is invalid.
    from tests.unit.test_claims_support import cdi_validator

    spec = gpu_spec()
    del spec["devices"][0]["containerEdits"]
    assert not cdi_validator(shared_dir).is_valid(spec)


def test_minimum_version_depends_on_the_claim_uid() -> None:
    # A CDI device name starting with a digit needs cdiVersion 0.5.0; otherwise the 0.3.0 baseline does.
    assert gpu_spec(UID)["cdiVersion"] == "0.3.0"
    assert gpu_spec(DIGIT_UID)["cdiVersion"] == "0.5.0"


@pytest.mark.parametrize(
    ("change", "version"),
    [
        (
            lambda s: s["containerEdits"].update(mounts=[{"hostPath": "/a", "containerPath": "/a", "type": "bind"}]),
            "0.4.0",
        ),
        (lambda s: s["devices"][0]["containerEdits"]["deviceNodes"][0].update(hostPath="/dev/nvidia0"), "0.5.0"),
        (lambda s: s.update(annotations={"a": "b"}), "0.6.0"),
        (lambda s: s["devices"][0].update(annotations={"a": "b"}), "0.6.0"),
        (lambda s: s.update(kind="example.com/gpu.class"), "0.6.0"),
        (lambda s: s["containerEdits"].update(additionalGids=[44]), "0.7.0"),
        (lambda s: s["containerEdits"].update(netDevices=[{"hostInterfaceName": "a", "name": "b"}]), "1.1.0"),
    ],
)
def test_minimum_version_rules(change: Any, version: str) -> None:
    spec = gpu_spec(UID)
    change(spec)
    assert cdi.minimum_version(spec) == version


MIG_MINORS = """config 1
monitor 2
gpu0/gi0/access 3
gpu0/gi0/ci0/access 4
gpu0/gi1/access 12
gpu0/gi1/ci0/access 13
gpu4/gi9/access 624
gpu4/gi9/ci0/access 625
"""


def test_mig_cap_nodes_come_from_the_mig_minors_file() -> None:
    caps = MigCaps(lambda: MIG_MINORS.replace(" 624", " 900"))
    assert cdi.mig_device_nodes(4, 9, 0, caps) == (
        "/dev/nvidia4",
        "/dev/nvidia-caps/nvidia-cap900",
        "/dev/nvidia-caps/nvidia-cap625",
    )


def test_default_mig_minors_follow_the_driver_numbering() -> None:
    # Without the file, the pattern nvidia-modprobe uses must reproduce every line of a real file.
    for key, minor in cdi.parse_mig_minors(MIG_MINORS).items():
        if key.startswith("gpu"):
            parts = key.split("/")
            gpu_minor, gi = int(parts[0][3:]), int(parts[1][2:])
            ci = int(parts[2][2:]) if len(parts) == 4 else None
            assert cdi.default_mig_minor(gpu_minor, gi, ci) == minor, key
    assert MigCaps(lambda: None).device_nodes(0, 1, 0) == (
        "/dev/nvidia-caps/nvidia-cap12",
        "/dev/nvidia-caps/nvidia-cap13",
    )


def test_a_malformed_mig_minors_file_is_an_error() -> None:
    with pytest.raises(ValueError, match="line 2"):
        cdi.parse_mig_minors("config 1\ngpu0/gi0/access three\n")


def test_store_writes_json_and_removes(tmp_path: pathlib.Path) -> None:
    store = CdiStore(tmp_path / "cdi")
    spec = gpu_spec()
    path = store.write(UID, spec)
    assert path == tmp_path / "cdi" / f"k8s.gpu.nvidia.com-claim_{UID}.json"
    assert json.loads(path.read_text()) == spec == store.read(UID)
    (tmp_path / "cdi" / "nvidia.yaml").write_text("other vendor")  # never ours
    assert store.claim_uids() == {UID}
    assert store.leftover_temps() == []
    assert store.remove(UID) is True
    assert store.remove(UID) is False
    assert sorted(p.name for p in (tmp_path / "cdi").iterdir()) == ["nvidia.yaml"]


def test_an_older_agents_yaml_spec_is_still_this_drivers(tmp_path: pathlib.Path) -> None:
    # Tried: a spec an agent before issue 37 wrote (YAML) on the node after the upgrade: found, read, kept
    # (exists), removed with its claim; a new write of the claim replaces it, never leaving two specs (CDI
    # refuses a device two files define).
    store = CdiStore(tmp_path / "cdi")
    store.root.mkdir()
    legacy = store.root / f"k8s.gpu.nvidia.com-claim_{UID}.yaml"
    legacy.write_text(yaml.safe_dump(gpu_spec(), sort_keys=False))
    assert store.claim_uids() == {UID}
    assert store.exists(UID) and store.read(UID) == gpu_spec()
    assert store.remove(UID) is True and not legacy.exists() and not store.exists(UID)
    legacy.write_text(yaml.safe_dump(gpu_spec(), sort_keys=False))
    store.write(UID, gpu_spec())
    assert sorted(p.name for p in store.root.iterdir()) == [f"k8s.gpu.nvidia.com-claim_{UID}.json"]
    legacy.write_text("devices: [")  # damaged, beside no JSON one
    store.path(UID).unlink()
    with pytest.raises(ValueError, match="not YAML"):
        store.read(UID)


def test_a_spec_written_with_driver_edits_is_what_with_driver_edits_makes(tmp_path: pathlib.Path) -> None:
    # The driver's part is encoded once and spliced into each spec: the file must still be the merged document.
    driver = {
        "mounts": [{"hostPath": "/lib/libcuda.so.1", "containerPath": "/lib/libcuda.so.1", "options": ["ro"]}],
        "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook", "args": ["a", "b"]}],
        "env": ["FROM_DRIVER=1"],
    }
    store = CdiStore(tmp_path, driver)
    own = gpu_spec()
    mount = {"hostPath": "/x", "containerPath": "/y"}
    with_mount = {**own, "containerEdits": {**own["containerEdits"], "mounts": [mount]}}
    with_rdt = {**own, "containerEdits": {**own["containerEdits"], "intelRdt": {"closID": "c"}}}  # an object
    for spec in (own, with_mount, with_rdt, {**own, "containerEdits": {}}):
        written = json.loads(store.write(UID, spec).read_text())
        assert written == cdi.with_driver_edits(spec, driver)
        assert written["containerEdits"]["env"][0] == "FROM_DRIVER=1"  # the driver's edits come first
    assert json.loads(CdiStore(tmp_path).write(UID, own).read_text()) == own  # without a driver, the claim's own


def test_a_failed_write_leaves_the_old_spec_and_no_temp_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CdiStore(tmp_path)
    store.write(UID, gpu_spec())
    before = store.path(UID).read_bytes()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        store.write(UID, gpu_spec(DIGIT_UID))
    assert store.path(UID).read_bytes() == before
    assert os.listdir(tmp_path) == [store.path(UID).name]
