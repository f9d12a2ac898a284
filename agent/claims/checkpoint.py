"""The prepared-claims checkpoint: which claims this node prepared, and how far each got.

On disk (`<state-dir>/checkpoint.json`):

    {"version": 1, "checksum": "sha256:<hex of canonical data>",
     "data": {"nodeBootID": "...", "claims": {"<uid>": {"namespace", "name", "state", "devices", "cdiSpec"}}}}

- Two phases per claim: `PrepareStarted` is written before any side effect, `PrepareCompleted` after the
  CDI spec is on disk, so a crash leaves either nothing or a Started entry that can be rolled back.
- Versioned: this build reads every version up to `VERSION` and refuses a newer one (written by a newer
  agent) instead of guessing. A new field gets a default when read, so older files stay readable.
- Checksummed over the canonical JSON of `data` (sorted keys), so re-encoding never changes it.
- A corrupt file (bad JSON, bad checksum, bad shape) raises CheckpointCorrupt and is left where it is:
  dropping it would forget prepared claims whose devices are in use, so the agent refuses to prepare or
  unprepare and says why in every result (an operator moves the file aside to reset). A missing file is
  an empty checkpoint.
- `nodeBootID` is the boot the claims were prepared in; the state machine voids claims of another boot.
- A device that prepare created (a MIG placement offered as a partitionable device) carries `dynamicMig`:
  the placement, written in the Started entry before creating, and the instance ids once created. Only
  such devices are ever destroyed by the agent; operators' MIG devices have no `dynamicMig`.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.claims import files

VERSION = 1
FILE_NAME = "checkpoint.json"
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


class CheckpointCorrupt(Exception):
    """The checkpoint cannot be trusted; the message says where and why."""


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
    dynamic_mig: DynamicMig | None = None


@dataclass(frozen=True)
class ClaimEntry:
    uid: str
    namespace: str
    name: str
    state: ClaimState
    devices: tuple[CheckpointedDevice, ...] = ()
    cdi_spec: Mapping[str, Any] | None = field(default=None, compare=False)  # kept to rewrite a lost file


@dataclass
class Checkpoint:
    boot_id: str
    claims: dict[str, ClaimEntry] = field(default_factory=dict)


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
    if d.dynamic_mig is not None:  # absent otherwise: files without created devices read as before
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
        dynamic_mig=_dynamic_mig_from_json(raw.get("dynamicMig")),
    )


def _canonical(data: Mapping[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _checksum(data: Mapping[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


def encode(cp: Checkpoint) -> bytes:
    data = {
        "nodeBootID": cp.boot_id,
        "claims": {
            uid: {
                "namespace": e.namespace,
                "name": e.name,
                "state": e.state.value,
                "devices": [_device_to_json(d) for d in e.devices],
                "cdiSpec": e.cdi_spec,
            }
            for uid, e in sorted(cp.claims.items())
        },
    }
    # Compact: the C encoder is ~10x faster than the indenting one, and prepare latency counts.
    return json.dumps({"version": VERSION, "checksum": _checksum(data), "data": data}, separators=(",", ":")).encode()


def decode(raw: bytes, where: str = "checkpoint") -> Checkpoint:
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorrupt(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), dict):
        raise CheckpointCorrupt(f"{where}: not a checkpoint (no 'data' object)")
    version = doc.get("version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointCorrupt(f"{where}: bad version {version!r}")
    if version > VERSION:
        raise CheckpointTooNew(f"{where}: version {version} is newer than this agent's {VERSION}; upgrade it")
    data = doc["data"]
    if doc.get("checksum") != _checksum(data):
        raise CheckpointCorrupt(f"{where}: checksum mismatch (file damaged or edited)")
    try:
        return Checkpoint(
            boot_id=str(data["nodeBootID"]),
            claims={
                uid: ClaimEntry(
                    uid=uid,
                    namespace=c["namespace"],
                    name=c["name"],
                    state=ClaimState(c["state"]),
                    devices=tuple(_device_from_json(d) for d in c.get("devices", ())),
                    cdi_spec=c.get("cdiSpec"),
                )
                for uid, c in data["claims"].items()
            },
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointCorrupt(f"{where}: bad content ({type(exc).__name__}: {exc})") from None


def read_boot_id() -> str:
    return BOOT_ID_PATH.read_text().strip()


class CheckpointStore:
    """The checkpoint file in `state_dir`; callers serialise access (agent.claims.lock)."""

    def __init__(self, state_dir: Path, boot_id: Callable[[], str] = read_boot_id) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self._boot_id = boot_id

    def boot_id(self) -> str:
        return self._boot_id()

    def load(self) -> Checkpoint:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return Checkpoint(boot_id=self.boot_id())
        return decode(raw, str(self.path))

    def save(self, cp: Checkpoint) -> None:
        files.write_atomic(self.path, encode(cp))

    def leftover_temps(self) -> list[Path]:
        return files.leftover_temps(self.path.parent, FILE_NAME + ".")
