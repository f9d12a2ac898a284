"""Per-claim CDI specs: what a container runtime injects for the devices of one prepared claim.

One transient spec per claim, `<cdi-root>/k8s.gpu.nvidia.com-claim_<uid>.json` (`.yaml` from agents before
issue 37, still found and removed), kind
`k8s.gpu.nvidia.com/claim`, one CDI device `<uid>-<device name>` per allocated device, as NVIDIA's DRA
driver writes them. Device nodes carry only `path`: the runtime reads type and major/minor from the host
node, and leaving out `hostPath` keeps the spec loadable by runtimes with older CDI libraries. Only a dev
root other than `/` (`--dev-root`) adds `hostPath`, beneath it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from agent import files
from agent.claims.types import uid_problem
from agent.devices.names import InvalidDeviceName, parse_device_name

log = logging.getLogger(__name__)

VENDOR = "k8s.gpu.nvidia.com"
CLASS = "claim"
KIND = f"{VENDOR}/{CLASS}"
_FILE_PREFIX = f"{VENDOR}-{CLASS}_"
SUFFIX = ".json"
LEGACY_SUFFIX = ".yaml"  # what agents before issue 37 wrote

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MIG_MINORS_PATH = Path("/proc/driver/nvidia-caps/mig-minors")


def spec_file_name(claim_uid: str) -> str:
    return f"{_FILE_PREFIX}{claim_uid}{SUFFIX}"


def device_id(claim_uid: str, device_name: str, share_id: str = "") -> str:
    """The fully-qualified CDI device id handed to the kubelet: `k8s.gpu.nvidia.com/claim=<uid>-<device>`, and
    `<uid>-<device>-<shareID>` for a share of a consumable-capacity device (one claim may hold two shares of
    one GPU; the shareID keeps each its own device, stable across prepares)."""
    return f"{KIND}={cdi_name(claim_uid, device_name, share_id)}"


def cdi_name(claim_uid: str, device_name: str, share_id: str = "") -> str:
    return f"{claim_uid}-{device_name}" + (f"-{share_id}" if share_id else "")


def device_names(spec: Mapping[str, Any], claim_uid: str) -> tuple[str, ...]:
    """The DRA device names a claim's spec gives containers (its CDI names without the uid and any shareID)."""
    found: dict[str, None] = {}
    for device in spec.get("devices") or ():
        name = str(device.get("name", "")) if isinstance(device, Mapping) else ""
        if not name.startswith(f"{claim_uid}-"):
            continue
        parts = name[len(claim_uid) + 1 :].split("-")
        for end in range(len(parts), 0, -1):  # the longest leading part that is a device name (a shareID follows)
            try:
                parse_device_name("-".join(parts[:end]))
            except InvalidDeviceName:
                continue
            found["-".join(parts[:end])] = None
            break
    return tuple(found)


# --- MIG capability device nodes ------------------------------------------------------------------------

# nvidia-modprobe numbers the MIG access capabilities in this fixed pattern (config=1, monitor=2, then per
# GPU minor 15 GPU instances, each followed by its 8 compute instances); /proc/driver/nvidia-caps/mig-minors
# lists it. The file is authoritative; the pattern is the fallback when it cannot be read (fakes, tests).
_GIS_PER_GPU = 15
_CIS_PER_GI = 8
_FIRST_GPU_MINOR = 3


def default_mig_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    per_gi = 1 + _CIS_PER_GI
    base = _FIRST_GPU_MINOR + gpu_minor * _GIS_PER_GPU * per_gi + gi * per_gi
    return base if ci is None else base + 1 + ci


def parse_mig_minors(text: str) -> dict[str, int]:
    """`gpu0/gi1/access 12` lines -> {"gpu0/gi1/access": 12}; malformed lines are an error."""
    minors = {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"mig-minors line {n}: {line!r} is not '<capability> <minor>'")
        minors[parts[0]] = int(parts[1])
    return minors


def read_mig_minors() -> str | None:
    try:
        return MIG_MINORS_PATH.read_text()
    except OSError:
        return None


class MigCaps:
    """Maps a MIG device's GPU/compute instance to its `/dev/nvidia-caps/nvidia-cap<N>` nodes."""

    def __init__(self, reader: Callable[[], str | None] = read_mig_minors) -> None:
        self._reader = reader
        self._minors: dict[str, int] | None = None

    def _table(self) -> dict[str, int]:
        if self._minors is None:
            text = self._reader()
            self._minors = parse_mig_minors(text) if text is not None else {}
        return self._minors

    def minor(self, gpu_minor: int, gi: int, ci: int | None = None) -> int:
        key = f"gpu{gpu_minor}/gi{gi}" + ("" if ci is None else f"/ci{ci}") + "/access"
        return self._table().get(key, default_mig_minor(gpu_minor, gi, ci))

    def device_nodes(self, gpu_minor: int, gi: int, ci: int) -> tuple[str, str]:
        return (
            f"/dev/nvidia-caps/nvidia-cap{self.minor(gpu_minor, gi)}",
            f"/dev/nvidia-caps/nvidia-cap{self.minor(gpu_minor, gi, ci)}",
        )


# --- Spec building (no I/O) -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CdiDevice:
    """One allocated device as the spec needs it."""

    name: str  # the DRA device name, e.g. gpu-0 or gpu-0-mig-1g10gb-19-0
    uuid: str  # GPU-... or MIG-...
    device_nodes: tuple[str, ...]
    share_id: str = ""  # a share of a consumable-capacity device
    env: tuple[str, ...] = ()  # what this device alone sets (a share's memory limit)


def gpu_device_nodes(minor: int) -> tuple[str, ...]:
    return (f"/dev/nvidia{minor}",)


def mig_device_nodes(parent_minor: int, gi: int, ci: int, caps: MigCaps) -> tuple[str, ...]:
    return (f"/dev/nvidia{parent_minor}", *caps.device_nodes(parent_minor, gi, ci))


def device_node(path: str, dev_root: Path | None = None) -> dict[str, str]:
    """A device node entry. With a dev root other than `/` (a driver container's /dev mounted elsewhere, or
    a test's stand-in nodes) the host's node lies beneath it, so the runtime is told where (`hostPath`)."""
    if dev_root is None or dev_root == Path("/"):
        return {"path": path}
    return {"path": path, "hostPath": str(dev_root / path.lstrip("/"))}


def claim_spec(
    claim_uid: str, devices: Sequence[CdiDevice], node_name: str, driver_name: str, dev_root: Path | None = None
) -> dict[str, Any]:
    """The spec for one claim. Claim-wide edits (control nodes, env) sit at the top level, which the runtime
    applies once when any device of the spec is injected; the driver's files join them when the spec is
    written (`with_driver_edits`), so the checkpoint keeps only what is the claim's own.

    `NVIDIA_VISIBLE_DEVICES=void`: the spec itself brings the driver's files, so NVIDIA's legacy runtime hook,
    where a node still runs it, must inject nothing a second time (as NVIDIA's generator sets it).
    """
    if not devices:
        raise ValueError("a CDI spec needs at least one device")
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": KIND,
        "containerEdits": {
            "env": [
                "NVIDIA_VISIBLE_DEVICES=void",
                f"KUBERNETES_NODE_NAME={node_name}",
                f"DRA_RESOURCE_DRIVER_NAME={driver_name}",
            ],
            "deviceNodes": [device_node(p, dev_root) for p in CONTROL_NODES],
        },
        "devices": [
            {
                "name": cdi_name(claim_uid, d.name, d.share_id),
                "containerEdits": {"deviceNodes": [device_node(p, dev_root) for p in d.device_nodes]}
                | ({"env": list(d.env)} if d.env else {}),
            }
            for d in devices
        ],
    }
    spec["cdiVersion"] = minimum_version(spec)
    return spec


def with_driver_edits(spec: Mapping[str, Any], driver: Mapping[str, Any]) -> dict[str, Any]:
    """`spec` with the driver's edits (agent.driver.edits) first in its claim-wide containerEdits, and the
    cdiVersion those need (a new dict; `spec` is left alone). CdiStore.encode writes the same document."""
    if not driver:
        return dict(spec)
    out = _with_first(spec, driver)
    out["cdiVersion"] = minimum_version(out)
    return out


def _with_first(spec: Mapping[str, Any], edits: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    own = spec.get("containerEdits") or {}
    merged = dict(own)
    for key, values in edits.items():
        merged[key] = [*values, *own.get(key, ())]
    return {**spec, "containerEdits": merged}


def _edits(spec: Mapping[str, Any]) -> Iterable[Mapping[str, Any]]:
    yield spec.get("containerEdits") or {}
    for d in spec.get("devices") or ():
        yield d.get("containerEdits") or {}


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest cdiVersion that allows every field the spec uses (the rules of the CDI library's
    MinimumRequiredVersion); runtimes with older CDI libraries reject newer versions, so never ask more."""
    edits = list(_edits(spec))
    devices = spec.get("devices") or ()
    vendor_class = str(spec.get("kind", "")).split("/", 1)
    if any("netDevices" in e for e in edits):
        return "1.1.0"
    if any("intelRdt" in e or "additionalGids" in e for e in edits):
        return "0.7.0"
    if "annotations" in spec or any("annotations" in d for d in devices) or "." in vendor_class[-1]:
        return "0.6.0"
    if any(str(d.get("name", ""))[:1].isdigit() for d in devices) or any(
        "hostPath" in n for e in edits for n in e.get("deviceNodes") or ()
    ):
        return "0.5.0"
    if any("type" in m for e in edits for m in e.get("mounts") or ()):
        return "0.4.0"
    return "0.3.0"


# --- Files ----------------------------------------------------------------------------------------------


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _json_items(values: Sequence[Any]) -> str:
    """A list's items as JSON, without the brackets (to splice into another list)."""
    return json.dumps(list(values), separators=(",", ":"))[1:-1]


class CdiStore:
    """One driver's claim specs under the CDI root, of CDI kind `kind` (other files there are never touched).

    Written as JSON, `k8s.gpu.nvidia.com-claim_<uid>.json`: CDI reads .json and .yaml specs alike, and the C
    JSON encoder, with the driver's edits encoded once at start-up and spliced in, makes a spec in tens of
    microseconds where the YAML dump took 0.6 ms. Specs an older agent wrote (`.yaml`) are still this
    driver's: found, read, kept for their claims and removed with them."""

    def __init__(self, root: Path, driver_edits: Mapping[str, Any] | None = None, *, kind: str = KIND) -> None:
        self.root = Path(root)
        self._prefix = kind.replace("/", "-") + "_"  # `<vendor>-<class>_<uid>.json`, as CDI names spec files
        self._file = re.compile(rf"^{re.escape(self._prefix)}(.+)(?:\.json|\.yaml)$")
        self.driver_edits = driver_edits or {}  # agent.driver.edits, built once at start-up, added to every spec
        # The same in every spec: encoded once, and the cdiVersion they need computed once.
        self._driver_json = {key: _json_items(values) for key, values in self.driver_edits.items()}
        self._driver_version = minimum_version({"containerEdits": self.driver_edits})

    def path(self, claim_uid: str) -> Path:
        """Where this agent writes the claim's spec."""
        if problem := uid_problem(claim_uid):  # callers check first; this keeps a bad UID out of any path
            raise ValueError(problem)
        return self.root / f"{self._prefix}{claim_uid}{SUFFIX}"

    def paths(self, claim_uid: str) -> tuple[Path, ...]:
        """Every name the claim's spec may have: this agent's, then an older agent's."""
        path = self.path(claim_uid)
        return path, path.with_name(f"{self._prefix}{claim_uid}{LEGACY_SUFFIX}")

    def encode(self, spec: Mapping[str, Any]) -> bytes:
        """The spec file's content: `spec` with the driver's edits first in its claim-wide containerEdits (as
        `with_driver_edits` merges them) and the cdiVersion both need."""
        own = spec.get("containerEdits") or {}
        version = max(minimum_version(spec), self._driver_version, key=_version_key)
        rest = {key: value for key, value in spec.items() if key not in ("cdiVersion", "containerEdits")}
        head = json.dumps({"cdiVersion": version, **rest}, separators=(",", ":"))
        edits = []
        for key in [*own, *(k for k in self._driver_json if k not in own)]:
            mine = own.get(key)
            if key not in self._driver_json and not isinstance(mine, list | tuple):  # e.g. intelRdt, an object
                edits.append(f"{json.dumps(key)}:{json.dumps(mine, separators=(',', ':'))}")
                continue
            parts = [part for part in (self._driver_json.get(key, ""), _json_items(mine or ())) if part]
            edits.append(f"{json.dumps(key)}:[{','.join(parts)}]")
        return f'{head[:-1]},"containerEdits":{{{",".join(edits)}}}}}\n'.encode()

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path, legacy = self.paths(claim_uid)
        # Not durable: the checkpoint keeps every spec and recovery rewrites a missing one, a power loss voids
        # the claim anyway (new boot id), and on nodes the CDI root (/var/run/cdi) is tmpfs.
        files.write_atomic(path, self.encode(spec), durable=False)
        files.remove(legacy)  # one spec per claim: CDI refuses a device two files define
        return path

    def read(self, claim_uid: str) -> Any:
        """The claim's spec as parsed from its file (JSON, or an older agent's YAML). Raises OSError when there
        is none, ValueError when it is not a spec's syntax."""
        path, legacy = self.paths(claim_uid)
        try:
            return json.loads(path.read_bytes())
        except FileNotFoundError:
            text = legacy.read_text()
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{legacy}: not YAML ({exc})") from None

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec, whichever agent version wrote it; False when there was none."""
        removed = [files.remove(path) for path in self.paths(claim_uid)]
        return any(removed)

    def exists(self, claim_uid: str) -> bool:
        return any(path.is_file() for path in self.paths(claim_uid))

    def claim_uids(self) -> set[str]:
        """Claims with a spec file here (either form). Something else under a spec's name (a directory) is
        not this driver's to remove: it is skipped, with a warning."""
        if not self.root.is_dir():
            return set()
        uids = set()
        for path in self.root.iterdir():
            if (m := self._file.match(path.name)) is None:
                continue
            if not path.is_file() or path.is_symlink():
                log.warning("skipping %s: not a CDI spec file", path)
                continue
            uids.add(m.group(1))
        return uids

    def leftover_temps(self) -> list[Path]:
        return files.leftover_temps(self.root, self._prefix)
