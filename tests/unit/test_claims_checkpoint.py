"""The prepared-claims checkpoint: round trips, the on-disk format, corruption, atomic writes."""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from agent.claims.checkpoint import (
    VERSION,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointedDevice,
    CheckpointStore,
    CheckpointTooNew,
    ClaimEntry,
    ClaimState,
    decode,
    encode,
)


def sample() -> Checkpoint:
    return Checkpoint(
        "boot-1",
        {
            "u1": ClaimEntry(
                "u1",
                "ns",
                "c1",
                ClaimState.COMPLETED,
                (
                    CheckpointedDevice(
                        ("gpu",), "node-a", "gpu-0", ("k8s.gpu.nvidia.com/claim=u1-gpu-0",), "GPU-0", "MPS"
                    ),
                ),
                {"cdiVersion": "0.3.0"},
            ),
            "u2": ClaimEntry(
                "u2",
                "ns",
                "c2",
                ClaimState.STARTED,
                (CheckpointedDevice(("a", "b"), "node-a", "gpu-1", ("x=y",), admin_access=True, share_id="s1"),),
            ),
        },
    )


# Written by version 1 of the format. Must stay readable by every later build.
V1_DOCUMENT = (
    '{"version": 1, "checksum": "sha256:e9bde1abcea23ab23d789be4edebce9ccfc5a3312295185e23a3fb3c509abe55", '
    '"data": {"nodeBootID": "boot-1", "claims": {"u1": {"namespace": "ns", "name": "c1", '
    '"state": "PrepareCompleted", "devices": [{"requestNames": ["gpu"], "poolName": "node-a", '
    '"deviceName": "gpu-0", "cdiDeviceIDs": ["k8s.gpu.nvidia.com/claim=u1-gpu-0"], "uuid": "GPU-0", '
    '"sharing": "MPS", "adminAccess": false, "shareID": ""}], "cdiSpec": {"cdiVersion": "0.3.0"}}}}}'
)


def test_round_trip_keeps_every_field() -> None:
    cp = sample()
    back = decode(encode(cp))
    assert back == cp
    assert back.claims["u1"].cdi_spec == {"cdiVersion": "0.3.0"}
    assert encode(back) == encode(cp)


def test_writes_the_current_version() -> None:
    assert json.loads(encode(sample()))["version"] == VERSION


def test_a_version_1_file_reads_back() -> None:
    cp = decode(V1_DOCUMENT.encode())
    assert cp.boot_id == "boot-1"
    assert cp.claims["u1"] == sample().claims["u1"]
    assert cp.claims["u1"].devices[0].sharing == "MPS"


def test_a_newer_version_is_refused() -> None:
    doc = json.loads(encode(sample()))
    doc["version"] = VERSION + 1
    with pytest.raises(CheckpointTooNew, match="newer than this agent"):
        decode(json.dumps(doc).encode())


def test_checksum_detects_an_edit() -> None:
    doc = json.loads(encode(sample()))
    doc["data"]["claims"]["u1"]["state"] = "PrepareStarted"  # still valid JSON and shape
    with pytest.raises(CheckpointCorrupt, match="checksum mismatch"):
        decode(json.dumps(doc).encode())


def test_key_order_and_whitespace_do_not_matter() -> None:
    doc = json.loads(encode(sample()))
    assert decode(json.dumps(doc, sort_keys=True).encode()) == sample()


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "no 'data' object"),
        (b'{"version": 0, "data": {}}', "bad version"),
        (b'{"version": "1", "data": {}}', "bad version"),
    ],
)
def test_garbage_is_corrupt(raw: bytes, error: str) -> None:
    with pytest.raises(CheckpointCorrupt, match=error):
        decode(raw, "cp.json")


def test_right_checksum_but_wrong_shape_is_corrupt() -> None:
    from agent.claims.checkpoint import _checksum

    data = {"nodeBootID": "b", "claims": {"u": {"namespace": "n"}}}  # entry without name/state
    raw = json.dumps({"version": 1, "checksum": _checksum(data), "data": data}).encode()
    with pytest.raises(CheckpointCorrupt, match="bad content"):
        decode(raw)


def test_missing_file_is_an_empty_checkpoint_of_this_boot(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(tmp_path, boot_id=lambda: "boot-7")
    assert store.load() == Checkpoint("boot-7")


def test_save_and_load(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(tmp_path, boot_id=lambda: "boot-1")
    store.save(sample())
    assert store.load() == sample()
    assert os.listdir(tmp_path) == ["checkpoint.json"]  # no temp file left


def test_a_failed_save_keeps_the_old_checkpoint_and_no_temp(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path, boot_id=lambda: "boot-1")
    store.save(sample())

    def failing_fsync(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="I/O error"):
        store.save(Checkpoint("boot-1"))
    monkeypatch.undo()
    assert store.load() == sample()
    assert os.listdir(tmp_path) == ["checkpoint.json"]


def test_corrupt_file_on_disk_is_reported_with_its_path(tmp_path: pathlib.Path) -> None:
    store = CheckpointStore(tmp_path, boot_id=lambda: "boot-1")
    store.save(sample())
    raw = store.path.read_bytes()
    store.path.write_bytes(raw.replace(b"gpu-0", b"gpu-9"))
    with pytest.raises(CheckpointCorrupt, match=f"{tmp_path}/checkpoint.json: checksum mismatch"):
        store.load()
