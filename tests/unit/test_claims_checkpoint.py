"""The prepared-claims checkpoint: one record per claim, round trips, the version 1 file migrated, corruption,
atomic writes, a copy kept in memory that another process's writes invalidate."""

from __future__ import annotations

import json
import os
import pathlib
from dataclasses import replace

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
    decode_legacy,
    decode_record,
    encode_record,
)
from agent.claims.lock import LockUnusable, NodeLock


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


# Written by version 1 of the format (one file, every claim). Must stay readable by every later build.
V1_DOCUMENT = (
    '{"version": 1, "checksum": "sha256:e9bde1abcea23ab23d789be4edebce9ccfc5a3312295185e23a3fb3c509abe55", '
    '"data": {"nodeBootID": "boot-1", "claims": {"u1": {"namespace": "ns", "name": "c1", '
    '"state": "PrepareCompleted", "devices": [{"requestNames": ["gpu"], "poolName": "node-a", '
    '"deviceName": "gpu-0", "cdiDeviceIDs": ["k8s.gpu.nvidia.com/claim=u1-gpu-0"], "uuid": "GPU-0", '
    '"sharing": "MPS", "adminAccess": false, "shareID": ""}], "cdiSpec": {"cdiVersion": "0.3.0"}}}}}'
)


def store(root: pathlib.Path, boot: str = "boot-1") -> CheckpointStore:
    return CheckpointStore(root, boot_id=lambda: boot)


def records(root: pathlib.Path) -> list[str]:
    return sorted(os.listdir(root / "claims"))


def test_a_record_round_trips_every_field() -> None:
    entry = sample().claims["u1"]
    boot, back = decode_record(encode_record("boot-1", entry))
    assert (boot, back) == ("boot-1", entry)
    assert back.cdi_spec == {"cdiVersion": "0.3.0"}
    assert encode_record(boot, back) == encode_record("boot-1", entry)
    assert json.loads(encode_record("b", entry))["version"] == VERSION == 2


def test_a_newer_version_is_refused() -> None:
    doc = json.loads(encode_record("b", sample().claims["u1"]))
    doc["version"] = VERSION + 1
    with pytest.raises(CheckpointTooNew, match="newer than this agent"):
        decode_record(json.dumps(doc).encode())


def test_checksum_detects_an_edit_and_the_error_says_the_remedy() -> None:
    doc = json.loads(encode_record("b", sample().claims["u1"]))
    doc["data"]["state"] = "PrepareStarted"  # still valid JSON and shape
    with pytest.raises(CheckpointCorrupt, match=r"checksum mismatch .*; move it aside to reset \(the kubelet"):
        decode_record(json.dumps(doc).encode())


def test_key_order_and_whitespace_do_not_matter() -> None:
    doc = json.loads(encode_record("b", sample().claims["u1"]))
    assert decode_record(json.dumps(doc, sort_keys=True, indent=2).encode())[1] == sample().claims["u1"]


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe", "not JSON"),
        (b"[]", "no 'data' object"),
        (b'{"version": 0, "data": {}}', "bad version"),
        (b'{"version": "1", "data": {}}', "bad version"),
        (b'{"version": true, "data": {}}', "bad version"),
        (V1_DOCUMENT.encode(), "not a claim record"),
    ],
)
def test_garbage_is_corrupt(raw: bytes, error: str) -> None:
    with pytest.raises(CheckpointCorrupt, match=error):
        decode_record(raw, "cp.json")


def test_right_checksum_but_wrong_shape_is_corrupt() -> None:
    from agent.claims.checkpoint import _checksum

    data = {"nodeBootID": "b", "uid": "u", "namespace": "n"}  # a record without name/state
    raw = json.dumps({"version": 2, "checksum": _checksum(data), "data": data}).encode()
    with pytest.raises(CheckpointCorrupt, match="bad content"):
        decode_record(raw)


def test_no_record_is_an_empty_checkpoint_of_this_boot(tmp_path: pathlib.Path) -> None:
    assert store(tmp_path, "boot-7").load() == Checkpoint("boot-7")


def test_save_and_load_one_record_per_claim(tmp_path: pathlib.Path) -> None:
    store(tmp_path).save(sample())
    assert store(tmp_path).load() == sample()
    assert records(tmp_path) == ["u1.json", "u2.json"]  # no temp file left


def test_a_save_writes_only_the_claims_that_changed(tmp_path: pathlib.Path) -> None:
    s = store(tmp_path)
    s.save(sample())
    before = {name: os.stat(tmp_path / "claims" / name).st_ino for name in records(tmp_path)}
    cp = s.load()
    cp.claims["u2"] = replace(cp.claims["u2"], state=ClaimState.COMPLETED)
    del cp.claims["u1"]
    cp.claims["u3"] = replace(sample().claims["u1"], uid="u3")
    s.save(cp)
    assert records(tmp_path) == ["u2.json", "u3.json"]
    assert os.stat(tmp_path / "claims" / "u2.json").st_ino != before["u2.json"]  # replaced
    untouched = s.load()
    untouched.claims["u3"] = untouched.claims["u3"]
    s.save(untouched)
    after = os.stat(tmp_path / "claims" / "u3.json").st_ino
    assert store(tmp_path).load() == cp
    s.save(s.load())
    assert os.stat(tmp_path / "claims" / "u3.json").st_ino == after  # an unchanged claim is not rewritten


def test_a_failed_save_keeps_the_old_records_and_no_temp(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = store(tmp_path)
    s.save(sample())

    def failing_rename(src: str, dst: str) -> None:
        raise OSError("I/O error")

    changed = s.load()
    changed.claims["u1"] = replace(changed.claims["u1"], state=ClaimState.STARTED)
    monkeypatch.setattr(os, "replace", failing_rename)
    with pytest.raises(OSError, match="I/O error"):
        s.save(changed)
    monkeypatch.undo()
    assert s.load() == sample() == store(tmp_path).load()
    assert records(tmp_path) == ["u1.json", "u2.json"]


def test_records_are_not_synced_once_their_boot_is_named_durably(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tried: two saves in one boot, noting every fsync (by the file it syncs) and rename. The first names the
    boot in claims.boot, durably, before any record; no record is ever fsynced (a prepare's save costs no
    journal commit), since whatever a power loss does to them is void after the reboot."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", pathlib.Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        real_fsync(fd)

    def rename(src: str, dst: str) -> None:
        events.append(("rename", pathlib.Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", rename)
    s = store(tmp_path)
    s.save(sample())
    first = events[:]
    events.clear()
    changed = s.load()
    changed.claims["u2"] = replace(changed.claims["u2"], state=ClaimState.COMPLETED)
    s.save(changed)
    monkeypatch.undo()
    assert first[:3] == [("fsync", first[0][1]), ("rename", "claims.boot"), ("fsync", tmp_path.name)]
    assert first[0][1].startswith("claims.boot.") and ("fsync", "u1.json") not in first
    # the claims directory made, then the records
    assert first[3:] == [("fsync", tmp_path.name), ("rename", "u1.json"), ("rename", "u2.json")]
    assert events == [("rename", "u2.json")]
    assert (tmp_path / "claims.boot").read_text() == "boot-1\n"
    assert store(tmp_path).load() == changed


def test_after_a_reboot_a_torn_record_is_void_not_fenced(tmp_path: pathlib.Path) -> None:
    """Tried: records saved in boot-1, one torn as a power loss may leave an unsynced file, then a load in the
    same boot and in boot-2. In boot-1 the damage is real and fences the claim; in boot-2 every record of
    boot-1 is void, the torn one too: it is removed instead of holding its devices until an operator acts."""
    store(tmp_path).save(sample())
    path = tmp_path / "claims" / "u1.json"
    path.write_bytes(path.read_bytes()[:40])
    assert set(store(tmp_path).load().fenced) == {"u1"}
    assert store(tmp_path, "boot-2").peek() == Checkpoint("boot-2")
    after = store(tmp_path, "boot-2").load()
    assert after.fenced == {} and set(after.claims) == {"u2"} and after.boot_id == "boot-1"  # the caller voids u2
    assert records(tmp_path) == ["u2.json"]


def test_a_torn_record_without_a_named_boot_stays_fenced(tmp_path: pathlib.Path) -> None:
    """Tried: records as an agent before claims.boot left them (it fsynced each one), one damaged, loaded in a
    later boot. Without a boot named, the damage cannot be told from a torn write: the claim stays fenced."""
    store(tmp_path).save(sample())
    (tmp_path / "claims.boot").unlink()
    path = tmp_path / "claims" / "u1.json"
    path.write_bytes(path.read_bytes()[:40])
    assert set(store(tmp_path, "boot-2").load().fenced) == {"u1"}


def test_a_corrupt_record_is_fenced_with_its_path_the_remedy_and_the_devices_it_shows(tmp_path: pathlib.Path) -> None:
    store(tmp_path).save(sample())
    path = tmp_path / "claims" / "u1.json"
    path.write_bytes(path.read_bytes().replace(b"gpu-0", b"gpu-9"))
    s = store(tmp_path)
    cp = s.load()
    assert set(cp.claims) == {"u2"}  # the other claim reads as ever
    fenced = cp.fenced["u1"]
    assert (fenced.path, fenced.devices) == (str(path), ("gpu-9",))
    assert fenced.reason.startswith(f"{path}: checksum mismatch") and "move it aside" in fenced.reason
    s.save(replace(cp, claims={}))  # a save never touches a fenced record
    assert records(tmp_path) == ["u1.json"] and set(store(tmp_path).peek().fenced) == {"u1"}


def test_while_a_record_is_fenced_a_load_reads_it_alone_again_and_sees_it_moved_aside(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tried: 1000 claims held, one record damaged. Each prepare's load read all 1000 records again (an operator
    # moving the fenced one aside writes no generation token): 54 ms a prepare, against 1.7 ms unfenced.
    store(tmp_path).save(sample())
    path = tmp_path / "claims" / "u1.json"
    path.write_bytes(b"\x00garbage")
    s = store(tmp_path)
    assert set(s.load().fenced) == {"u1"}
    read: list[str] = []
    real = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes", lambda self: read.append(self.name) or real(self))
    assert set(s.load().fenced) == {"u1"} and set(s.load().claims) == {"u2"}
    assert read.count("u2.json") == 0 and read.count("u1.json") == 2  # the fenced record alone, each load
    path.rename(tmp_path / "aside.json")  # the remedy
    cp = s.load()
    assert cp.fenced == {} and set(cp.claims) == {"u2"}


def test_a_record_under_another_claims_name_is_fenced_under_its_name(tmp_path: pathlib.Path) -> None:
    store(tmp_path).save(sample())
    os.replace(tmp_path / "claims" / "u1.json", tmp_path / "claims" / "u9.json")
    cp = store(tmp_path).load()
    assert "holds claim u1, not the one its name says" in cp.fenced["u9"].reason
    assert cp.fenced["u9"].devices == ("gpu-0",) and set(cp.claims) == {"u2"}


def test_a_version_1_file_is_migrated_to_records(tmp_path: pathlib.Path) -> None:
    legacy = tmp_path / "checkpoint.json"
    legacy.write_text(V1_DOCUMENT)
    cp = store(tmp_path).load()
    assert cp.boot_id == "boot-1"
    assert cp.claims["u1"] == sample().claims["u1"]
    assert cp.claims["u1"].devices[0].sharing == "MPS"
    assert not legacy.exists() and records(tmp_path) == ["u1.json"]
    assert store(tmp_path).load() == cp  # read back from the records
    assert decode_legacy(V1_DOCUMENT.encode()) == cp


def test_a_migration_cut_short_is_done_again(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    legacy = tmp_path / "checkpoint.json"
    legacy.write_text(V1_DOCUMENT)
    from agent import files

    def crash(path: pathlib.Path) -> bool:
        raise KeyboardInterrupt  # the agent dies after writing the records, before removing the old file

    monkeypatch.setattr(files, "remove", crash)
    with pytest.raises(KeyboardInterrupt):
        store(tmp_path).load()
    monkeypatch.undo()
    assert legacy.exists() and records(tmp_path) == ["u1.json"]
    assert store(tmp_path).load().claims == decode_legacy(V1_DOCUMENT.encode()).claims
    assert not legacy.exists()


def test_a_corrupt_version_1_file_is_refused_with_the_remedy(tmp_path: pathlib.Path) -> None:
    (tmp_path / "checkpoint.json").write_text(V1_DOCUMENT.replace("gpu-0", "gpu-9"))
    with pytest.raises(CheckpointCorrupt, match="checkpoint.json: checksum mismatch .* move it aside"):
        store(tmp_path).load()


@pytest.mark.parametrize("where", ["checkpoint.json", "claims/u1.json", "claims"])
def test_a_directory_where_a_checkpoint_file_belongs_is_one_sentence(tmp_path: pathlib.Path, where: str) -> None:
    if where == "claims":
        (tmp_path / "claims").write_text("not a directory")
    else:
        (tmp_path / where).mkdir(parents=True)
    if where == "claims/u1.json":  # one record: its claim alone is fenced
        message = store(tmp_path).load().fenced["u1"].reason
    else:
        with pytest.raises(CheckpointCorrupt) as caught:
            store(tmp_path).load()
        message = str(caught.value)
    assert str(tmp_path / where) in message and "\n" not in message
    assert "directory" in message


def test_the_lock_being_a_directory_is_one_sentence(tmp_path: pathlib.Path) -> None:
    (tmp_path / "pu.lock").mkdir()
    lock = NodeLock(tmp_path / "pu.lock")
    with pytest.raises(LockUnusable, match=f"{tmp_path}/pu.lock is a directory where the node lock file belongs"):
        lock.hold().__enter__()


def test_another_process_writing_is_seen_by_a_kept_copy(tmp_path: pathlib.Path) -> None:
    mine, other = store(tmp_path), store(tmp_path)  # two agents of a rolling update
    mine.save(sample())
    assert other.load() == sample()
    cp = other.load()
    del cp.claims["u1"]
    other.save(cp)
    assert set(mine.load().claims) == {"u2"}


def test_a_claim_uid_unfit_for_a_path_gets_no_record(tmp_path: pathlib.Path) -> None:
    cp = Checkpoint("boot-1", {"../x": replace(sample().claims["u1"], uid="../x")})
    with pytest.raises(ValueError, match="not a UID"):
        store(tmp_path).save(cp)
    assert not (tmp_path / "x.json").exists()


def test_a_peek_without_the_lock_reads_this_boots_claims_and_changes_nothing(tmp_path: pathlib.Path) -> None:
    # the MIG reconciler asks what holds a GPU while prepares may be writing (it takes the lock only for its
    # last check): tried, a peek beside a kept copy, a record gone meanwhile, a record of an earlier boot and a
    # version 1 file, none of which a peek may migrate, void or cache
    mine = store(tmp_path)
    mine.save(sample())
    assert mine.peek() == sample()
    other = store(tmp_path)
    cp = other.load()
    del cp.claims["u1"]
    other.save(cp)  # another writer removed u1's record
    assert set(mine.peek().claims) == {"u2"}
    assert store(tmp_path, "boot-2").peek() == Checkpoint("boot-2")  # after a reboot nothing holds a device
    assert records(tmp_path) == ["u2.json"]  # and nothing was voided by looking
    assert set(mine.load().claims) == {"u2"}  # what `load` keeps still follows the other writer
    legacy_root = tmp_path / "v1"
    legacy_root.mkdir()
    (legacy_root / "checkpoint.json").write_text(V1_DOCUMENT)
    assert set(store(legacy_root).peek().claims) == {"u1"}
    assert (legacy_root / "checkpoint.json").exists() and not (legacy_root / "claims").exists()  # not migrated
