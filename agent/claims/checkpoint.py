"""The prepared-claims checkpoint: which claims this node prepared, and how far each got.

On disk, one record per claim, so a prepare writes only its own claims whatever the node holds:

    <state-dir>/claims/<uid>.json
        {"version": 2, "checksum": "sha256:<hex of canonical data>",
         "data": {"nodeBootID", "uid", "namespace", "name", "state", "devices", "cdiSpec"}}

- Two phases per claim: `PrepareStarted` is written before any side effect on the node, `PrepareCompleted`
  after the CDI spec is on disk, so a crash leaves either nothing or a Started record that can be rolled
  back. A claim whose only side effect is its spec skips the Started record (agent.claims.state says why).
  Each record is replaced atomically (temp file, rename); records are independent, so a crash between two of
  them is as good as a crash between two claims. Records are not fsynced: a kill -9 loses nothing the page
  cache holds, and what a power loss can do to them (a rename or removal undone, a record torn) is void after
  the reboot. A torn record would read as damaged and fence its claim, so `claims.boot` (written durably before
  the first record of a boot) names the boot the records were written in: under another boot's name every
  record is void, damaged ones included, and is removed; under this boot's, a damaged record is fenced.
- Versioned: this build reads every version up to `VERSION` and refuses a newer one (written by a newer
  agent) instead of guessing. A new field gets a default when read, so older records stay readable.
  Version 1 was one file for every claim (`<state-dir>/checkpoint.json`): it is read once, written out as
  records and removed (a crash before the removal repeats the same migration).
- Checksummed over the canonical JSON of `data` (sorted keys), so re-encoding never changes it.
- A corrupt or stray record (bad JSON, bad checksum, bad shape, a newer version, a directory in its place, a
  name other than its claim's) fences its claim alone (`FencedRecord`), and is left where it is: dropping it
  would forget a prepared claim whose devices are in use. The devices it names, as far as they can be read,
  stay held (no other claim is prepared on them); prepare and unprepare of that claim fail with the record's
  path, the reason and the remedy; other claims go on. Once an operator moves it aside, the kubelet's retries
  prepare or unprepare the claim as usual (the unprepare of a claim with no record removes its spec).
  What cannot be told apart by claim (the version 1 file, `claims` not a directory, an unreadable generation
  token) raises CheckpointCorrupt, failing every claim. No record is an empty checkpoint.
- `nodeBootID` is the boot a record was written in; the state machine voids claims of another boot.
- A device that prepare created (a MIG placement offered as a partitionable device) carries `dynamicMig`:
  the placement, written in the Started record before creating, and the instance ids once created. Only
  such devices are ever destroyed by the agent; operators' MIG devices have no `dynamicMig`.
- The store keeps what it last read or wrote, and reads the records again only when another process wrote
  since (a rolling update runs two agents, serialised by the node lock): every write first changes a
  token in `<state-dir>/claims.generation`, so a stale copy is noticed before it is used.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent import files
from agent.claims.types import uid_problem

log = logging.getLogger(__name__)

VERSION = 2
LEGACY_FILE = "checkpoint.json"  # version 1: every claim in one file
RECORDS_DIR = "claims"
GENERATION_FILE = "claims.generation"
BOOT_FILE = "claims.boot"  # the boot the records were written in
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
_SUFFIX = ".json"
REMEDY = "move it aside to reset (the kubelet prepares its claims again)"


class CheckpointCorrupt(Exception):
    """The checkpoint cannot be trusted; the message says where, why and what to do."""


class CheckpointTooNew(CheckpointCorrupt):
    """Written by a newer agent in a format this build does not know."""


class ClaimState(enum.Enum):
    STARTED = "PrepareStarted"
    COMPLETED = "PrepareCompleted"


@dataclass(frozen=True)
class DynamicMig:
    """A MIG device created for claims at prepare, destroyed when its last claim goes.

    The placement is the intent, saved before creating; the ids are None until the device exists and they
    are saved, so a crash in between is repaired by finding the GPU instance at that placement.
    """

    parent_uuid: str
    gi_profile_id: int
    start: int
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None

    @property
    def created(self) -> bool:
        return self.gpu_instance_id is not None


@dataclass(frozen=True)
class CheckpointedDevice:
    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    uuid: str = ""
    sharing: str = ""  # "", "TimeSlicing" or "MPS": whether other claims may hold the device too
    admin_access: bool = False
    share_id: str = ""
    # A share's consumedCapacity as allocated (name -> quantity text): checked against the device at prepare.
    consumed: tuple[tuple[str, str], ...] = ()
    dynamic_mig: DynamicMig | None = None
    # Prepare switched the GPU's MIG mode for this device (on for a created MIG device, off for a whole GPU);
    # the last claim holding such a device switches it back.
    mig_mode_switched: bool = False


@dataclass(frozen=True)
class ClaimEntry:
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: tuple[CheckpointedDevice, ...] = ()
    cdi_spec: Mapping[str, Any] | None = field(default=None, compare=False)  # kept to rewrite a lost file


@dataclass(frozen=True)
class FencedRecord:
    """A claim record that cannot be trusted (see the module docstring): its claim is neither prepared nor
    unprepared here, and the devices read from it stay held, until an operator moves it aside."""

    uid: str  # as its file name says
    path: str
    reason: str  # the CheckpointCorrupt message: path, what is wrong, the remedy
    devices: tuple[str, ...] = ()  # device names read from it regardless of its checksum; () when unreadable

    def describe(self) -> str:
        held = f"it holds {', '.join(self.devices)}" if self.devices else "the devices it holds cannot be read"
        return f"the checkpoint record of claim {self.uid} cannot be trusted: {self.reason} ({held})"


@dataclass
class Checkpoint:
    boot_id: str
    claims: dict[str, ClaimEntry] = field(default_factory=dict)
    fenced: dict[str, FencedRecord] = field(default_factory=dict)  # by claim uid (file name)


# --- encoding -------------------------------------------------------------------------------------------


def _device_to_json(d: CheckpointedDevice) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requestNames": list(d.request_names),
        "poolName": d.pool_name,
        "deviceName": d.device_name,
        "cdiDeviceIDs": list(d.cdi_device_ids),
        "uuid": d.uuid,
        "sharing": d.sharing,
        "adminAccess": d.admin_access,
        "shareID": d.share_id,
    }
    if d.consumed:  # absent otherwise, as below
        out["consumedCapacity"] = dict(d.consumed)
    if d.mig_mode_switched:
        out["migModeSwitched"] = True
    if d.dynamic_mig is not None:  # absent otherwise: records without created devices read as before
        m = d.dynamic_mig
        out["dynamicMig"] = {
            "parentUUID": m.parent_uuid,
            "giProfileID": m.gi_profile_id,
            "placementStart": m.start,
            "gpuInstanceID": m.gpu_instance_id,
            "computeInstanceID": m.compute_instance_id,
        }
    return out


def _dynamic_mig_from_json(raw: Mapping[str, Any] | None) -> DynamicMig | None:
    if raw is None:
        return None
    gi, ci = raw.get("gpuInstanceID"), raw.get("computeInstanceID")
    return DynamicMig(
        parent_uuid=str(raw["parentUUID"]),
        gi_profile_id=int(raw["giProfileID"]),
        start=int(raw["placementStart"]),
        gpu_instance_id=None if gi is None else int(gi),
        compute_instance_id=None if ci is None else int(ci),
    )


def _device_from_json(raw: Mapping[str, Any]) -> CheckpointedDevice:
    return CheckpointedDevice(
        request_names=tuple(raw["requestNames"]),
        pool_name=raw["poolName"],
        device_name=raw["deviceName"],
        cdi_device_ids=tuple(raw["cdiDeviceIDs"]),
        uuid=raw.get("uuid", ""),
        sharing=raw.get("sharing", ""),
        admin_access=bool(raw.get("adminAccess", False)),
        share_id=raw.get("shareID", ""),
        consumed=tuple(sorted((str(k), str(v)) for k, v in (raw.get("consumedCapacity") or {}).items())),
        dynamic_mig=_dynamic_mig_from_json(raw.get("dynamicMig")),
        mig_mode_switched=bool(raw.get("migModeSwitched", False)),
    )


def _entry_from_json(uid: str, c: Mapping[str, Any]) -> ClaimEntry:
    return ClaimEntry(
        uid=uid,
        namespace=c["namespace"],
        name=c["name"],
        state=ClaimState(c["state"]),
        devices=tuple(_device_from_json(d) for d in c.get("devices", ())),
        cdi_spec=c.get("cdiSpec"),
    )


def _canonical(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _checksum(data: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def _verified_data(raw: bytes, where: str) -> tuple[int, Any]:
    """The version and the checksummed `data` of a document, or CheckpointCorrupt saying what is wrong."""
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{where}: not JSON ({exc}); {REMEDY}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint (no 'data' object); {REMEDY}")
    version = doc.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointCorrupt(f"{where}: bad version {version!r}; {REMEDY}")
    if version > VERSION:
        raise CheckpointTooNew(f"{where}: version {version} is newer than this agent's {VERSION}; upgrade it")
    data = doc["data"]
    if doc.get("checksum") != _checksum(data):
        raise CheckpointCorrupt(f"{where}: checksum mismatch (file damaged or edited); {REMEDY}")
    return version, data


def encode_record(boot_id: str, entry: ClaimEntry) -> bytes:
    """One claim's record. Compact: the C encoder is ~10x faster than the indenting one."""
    data = {
        "nodeBootID": boot_id,
        "uid": entry.uid,
        "namespace": entry.namespace,
        "name": entry.name,
        "state": entry.state.value,
        "devices": [_device_to_json(d) for d in entry.devices],
        "cdiSpec": entry.cdi_spec,
    }
    return json.dumps({"version": VERSION, "checksum": _checksum(data), "data": data}, separators=(",", ":")).encode()


def decode_record(raw: bytes, where: str = "record") -> tuple[str, ClaimEntry]:
    """The boot id and claim of one record."""
    version, data = _verified_data(raw, where)
    if version < 2:
        raise CheckpointCorrupt(f"{where}: a version {version} checkpoint is not a claim record; {REMEDY}")
    try:
        return str(data["nodeBootID"]), _entry_from_json(str(data["uid"]), data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{where}: bad content ({type(exc).__name__}: {exc}); {REMEDY}") from None


def decode_legacy(raw: bytes, where: str = "checkpoint") -> Checkpoint:
    """A version 1 checkpoint file (every claim in one document)."""
    version, data = _verified_data(raw, where)
    if version != 1:
        raise CheckpointCorrupt(f"{where}: version {version} is a claim record, not a checkpoint file; {REMEDY}")
    try:
        return Checkpoint(
            boot_id=str(data["nodeBootID"]),
            claims={uid: _entry_from_json(uid, c) for uid, c in data["claims"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{where}: bad content ({type(exc).__name__}: {exc}); {REMEDY}") from None


def read_boot_id() -> str:
    return BOOT_ID_PATH.read_text().strip()


# --- the store ------------------------------------------------------------------------------------------


def _salvaged_devices(raw: bytes | None) -> tuple[str, ...]:
    """The device names a damaged record still shows (its checksum, version or shape aside), so they stay held."""
    try:
        devices = json.loads(raw or b"")["data"]["devices"]
        return tuple(
            dict.fromkeys(
                str(d["deviceName"]) for d in devices if isinstance(d, dict) and isinstance(d.get("deviceName"), str)
            )
        )
    except (ValueError, UnicodeDecodeError, LookupError, TypeError):
        return ()


def _read_record(path: Path) -> tuple[str, ClaimEntry] | FencedRecord | None:
    """One record's boot id and claim; a FencedRecord when it cannot be trusted; None when it is gone."""
    uid = path.name[: -len(_SUFFIX)]
    raw = None
    try:
        raw = _read(path)
        record_boot, entry = decode_record(raw, str(path))
    except CheckpointCorrupt as exc:
        if raw is None and not path.exists() and not path.is_symlink():
            return None  # removed meanwhile (a lock-free peek, an operator moving it aside)
        return FencedRecord(uid, str(path), str(exc), _salvaged_devices(raw))
    if entry.uid != uid:  # a stray: whose claim it is cannot be trusted either
        reason = f"{path}: holds claim {entry.uid}, not the one its name says; {REMEDY}"
        return FencedRecord(uid, str(path), reason, tuple(dict.fromkeys(d.device_name for d in entry.devices)))
    return record_boot, entry


def _read(path: Path) -> bytes:
    """A checkpoint file's bytes; something else in its place is corrupt, not an OSError traceback."""
    try:
        return path.read_bytes()
    except IsADirectoryError:
        raise CheckpointCorrupt(f"{path} is a directory where a checkpoint file belongs; {REMEDY}") from None
    except OSError as exc:
        raise CheckpointCorrupt(f"{path} cannot be read ({exc.strerror or exc})") from None


class CheckpointStore:
    """The claim records under `state_dir`; callers serialise access (agent.claims.lock)."""

    def __init__(self, state_dir: Path, boot_id: Callable[[], str] = read_boot_id) -> None:
        self.state_dir = Path(state_dir)
        self.legacy_path = self.state_dir / LEGACY_FILE
        self.records = self.state_dir / RECORDS_DIR
        self._generation_path = self.state_dir / GENERATION_FILE
        self._boot_path = self.state_dir / BOOT_FILE
        self._written_in: str | None = None  # the boot `claims.boot` names, as last read or written
        self._boot_id = boot_id
        self._saved: Checkpoint | None = None  # what the records hold, as of `_generation`
        self._generation: bytes | None = None

    def boot_id(self) -> str:
        return self._boot_id()

    def record_path(self, uid: str) -> Path:
        if problem := uid_problem(uid):  # callers check first; this keeps a bad UID out of any path
            raise ValueError(problem)
        return self.records / f"{uid}{_SUFFIX}"

    def completed_hint(self, uid: str) -> bool:
        """Whether the claim was Completed when last read or written here, without I/O or the lock: a hint
        (another process may have changed it since) that spares reading a prepared claim again."""
        saved = self._saved
        entry = saved.claims.get(uid) if saved is not None else None
        return entry is not None and entry.state is ClaimState.COMPLETED

    def load(self) -> Checkpoint:
        """Every claim recorded (a copy the caller may change and pass to `save`), and the fenced records."""
        token = self._read_generation()
        if self._saved is None or token != self._generation or not self._fenced_as_read(self._saved):
            self._generation = token
            self._saved = self._read_all()
        return Checkpoint(self._saved.boot_id, dict(self._saved.claims), dict(self._saved.fenced))

    def _fenced_as_read(self, saved: Checkpoint) -> bool:
        """Whether every fenced record is still as it was read. An operator moving one aside (or mending it)
        writes no generation token, so each is read again, alone: the other records changed only with a new
        token, and reading them all on every load would cost a prepare ~50 ms at 1000 claims held."""
        return all(_read_record(Path(record.path)) == record for record in saved.fenced.values())

    def peek(self) -> Checkpoint:
        """The claims of this boot recorded, read for a thread that may not hold the lock: nothing `load` keeps
        is touched and nothing is written (no migration, no voiding); a record written or removed meanwhile
        may be missed. Claims of an earlier boot are left out: a reboot released their devices."""
        boot = self.boot_id()
        claims: dict[str, ClaimEntry] = {}
        fenced: dict[str, FencedRecord] = {}
        if self.legacy_path.is_file():
            with contextlib.suppress(FileNotFoundError):  # migrated meanwhile: its records are read below
                legacy = decode_legacy(self.legacy_path.read_bytes(), str(self.legacy_path))
                if legacy.boot_id == boot:
                    claims = dict(legacy.claims)
        for path in sorted(self.records.iterdir()) if self.records.is_dir() else ():
            if not path.name.endswith(_SUFFIX) or (read := _read_record(path)) is None:
                continue  # not a record, or unprepared meanwhile
            if isinstance(read, FencedRecord):
                if self._named_boot() in (None, boot):  # read, not kept: a peek changes nothing `load` keeps
                    fenced[read.uid] = read
            elif read[0] == boot:
                claims[read[1].uid] = read[1]
        return Checkpoint(boot, claims, fenced)

    def save(self, cp: Checkpoint) -> None:
        """Write the records of claims that changed since the last load or save and remove those of claims
        gone: one record per claim touched, whatever the node holds."""
        saved = self._saved if self._saved is not None else self._read_all()
        rewrite = saved.boot_id != cp.boot_id  # every record carries the boot id
        changed = [e for uid, e in cp.claims.items() if rewrite or saved.claims.get(uid) is not e]
        gone = [uid for uid in saved.claims if uid not in cp.claims]
        if changed or gone:
            try:
                self._name_boot(cp.boot_id)
                self._bump_generation()
                self._write(cp.boot_id, changed, gone)
            except BaseException:
                self._saved = None  # some records may have changed: read them again next time
                raise
        self._saved = Checkpoint(cp.boot_id, dict(cp.claims), dict(saved.fenced))  # fenced records: never written

    def leftover_temps(self) -> list[Path]:
        return (
            files.leftover_temps(self.records, "")
            + files.leftover_temps(self.state_dir, LEGACY_FILE + ".")
            + files.leftover_temps(self.state_dir, BOOT_FILE + ".")
        )

    # --- internals ------------------------------------------------------------------------------------

    def _write(self, boot_id: str, changed: Iterable[ClaimEntry], gone: Iterable[str]) -> None:
        if not self.records.is_dir():
            if self.records.exists():
                raise CheckpointCorrupt(f"{self.records} is not a directory; {REMEDY}")
            self.records.mkdir(mode=0o700, parents=True, exist_ok=True)
            files.fsync_dir(self.state_dir)
        # Not durable (see the module docstring): whatever a power loss does to a record is void after the
        # reboot, as `claims.boot` tells; until then the page cache is what every process reads.
        records = {self.record_path(e.uid): encode_record(boot_id, e) for e in changed}
        files.write_atomic_many(records, durable=False)
        for uid in gone:
            files.remove(self.record_path(uid))

    def _read_all(self) -> Checkpoint:
        boot = self.boot_id()
        claims: dict[str, ClaimEntry] = {}
        boots: set[str] = set()
        if self.legacy_path.exists() or self.legacy_path.is_symlink():
            legacy = self._migrate()
            claims, boots = dict(legacy.claims), {legacy.boot_id}
        if self.records.exists() and not self.records.is_dir():
            raise CheckpointCorrupt(f"{self.records} is not a directory; {REMEDY}")
        fenced: dict[str, FencedRecord] = {}
        for path in sorted(self.records.iterdir()) if self.records.is_dir() else ():
            if not path.name.endswith(_SUFFIX) or (read := _read_record(path)) is None:
                continue  # temp files (recovery removes them) and anything else that is no record
            if isinstance(read, FencedRecord):
                if self._void(boot):  # torn by the power loss that ended that boot, most likely: void anyway
                    log.warning("voiding the damaged record of claim %s of an earlier boot: %s", read.uid, read.reason)
                    files.remove(path)
                else:
                    fenced[read.uid] = read
                continue
            record_boot, entry = read
            claims[entry.uid] = entry
            boots.add(record_boot)
        # Records of another boot make the whole checkpoint that boot's, which the state machine voids.
        return Checkpoint(next(iter(sorted(boots - {boot})), boot), claims, fenced)

    def _migrate(self) -> Checkpoint:
        """Version 1 -> records: write them all, then remove the old file (a crash in between redoes it)."""
        legacy = decode_legacy(_read(self.legacy_path), str(self.legacy_path))
        self._bump_generation()
        self._write(legacy.boot_id, legacy.claims.values(), ())
        files.remove(self.legacy_path)
        files.fsync_dir(self.state_dir)
        return legacy

    def _void(self, boot: str) -> bool:
        """Whether the records were written in a boot other than `boot`."""
        if self._written_in is None:
            self._written_in = self._named_boot()
        return self._written_in not in (None, boot)

    def _named_boot(self) -> str | None:
        """The boot `claims.boot` names; None without one (records of an agent before it, which fsynced every
        record, so a damaged one is real damage)."""
        try:
            return self._boot_path.read_text().strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise CheckpointCorrupt(f"{self._boot_path} cannot be read ({exc}); {REMEDY}") from None

    def _name_boot(self, boot: str) -> None:
        """Name `boot` in `claims.boot`, durably, before the first record of it is written: records written
        after are not fsynced, so a power loss must find them under a boot that is gone."""
        if self._written_in != boot:
            files.write_atomic(self._boot_path, boot.encode() + b"\n")
            self._written_in = boot

    def _read_generation(self) -> bytes | None:
        try:
            return self._generation_path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointCorrupt(f"{self._generation_path} cannot be read ({exc.strerror or exc})") from None

    def _bump_generation(self) -> None:
        """Tell other processes their copy is stale, before any record changes (not durable: after a crash
        or reboot every process starts without a copy)."""
        token = secrets.token_hex(8).encode()
        with contextlib.suppress(FileNotFoundError):
            if self._generation_path.is_dir():
                raise CheckpointCorrupt(f"{self._generation_path} is a directory; {REMEDY}")
        # Overwritten in place, never truncated: on ext4 a truncate waits for the writeback that closing a
        # file truncated before had started (auto_da_alloc), ~1 ms a save. Every token is as long as the
        # last; a reader that catches a write halfway sees neither token, which also reads as "changed".
        fd = os.open(self._generation_path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, token, 0)
            if os.fstat(fd).st_size > len(token):  # an older or foreign file, longer: cut once
                os.ftruncate(fd, len(token))
        finally:
            os.close(fd)
        self._generation = token
