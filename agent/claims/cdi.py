"""Per-claim CDI specs: what a container runtime injects for the devices of one prepared claim.

One transient spec per claim, `<cdi-root>/k8s.gpu.nvidia.com-claim_<uid>.yaml`, kind
`k8s.gpu.nvidia.com/claim`, one CDI device `<uid>-<device name>` per allocated device, as NVIDIA's DRA
driver writes them. Device nodes carry only `path`: the runtime reads type and major/minor from the host
node, and leaving out `hostPath` keeps the spec loadable by runtimes with older CDI libraries. Only a dev
root other than `/` (`--dev-root`) adds `hostPath`, beneath it.
"""

from __future__ import annotations

import io
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
_FILE = re.compile(rf"^{re.escape(_FILE_PREFIX)}(.+)\.yaml$")

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
MIG_MINORS_PATH = Path("/proc/driver/nvidia-caps/mig-minors")


def spec_file_name(claim_uid: str) -> str:
    return f"{_FILE_PREFIX}{claim_uid}.yaml"


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


def with_driver_edits(
    spec: Mapping[str, Any], driver: Mapping[str, Any], written: Mapping[str, Sequence[Any]] | None = None
) -> dict[str, Any]:
    """`spec` with the driver's edits (agent.driver.edits) first in its claim-wide containerEdits, and the
    cdiVersion those need (a new dict; `spec` is left alone). `written`: the same edits in the form to write
    them in (CdiStore's, represented once), put in their place; the cdiVersion still comes from `driver`."""
    if not driver:
        return dict(spec)
    out = _with_first(spec, driver)
    version = minimum_version(out)
    if written is not None:
        out = _with_first(spec, written)
    out["cdiVersion"] = version
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

try:  # the C dumper is ~10x faster, and prepare latency is on the pod start path
    _Dumper: Any = yaml.CSafeDumper
except AttributeError:  # pragma: no cover - PyYAML built without libyaml
    _Dumper = yaml.SafeDumper


class _Represented:
    """A value already represented as a YAML node, written as it is."""

    __slots__ = ("node",)

    def __init__(self, node: yaml.Node) -> None:
        self.node = node


class _SpecDumper(_Dumper):  # type: ignore[misc]
    """The claim specs' dumper: writes a `_Represented` value as its node."""


_SpecDumper.add_representer(_Represented, lambda _dumper, data: data.node)


def _represented(edits: Mapping[str, Sequence[Any]]) -> dict[str, list[_Represented]]:
    """Each list item of `edits` represented once, as `yaml.dump` in CdiStore.write represents it: the driver's
    edits are the same in every spec, and representing their hundreds of strings was most of a write's time."""
    dumper = _SpecDumper(io.StringIO(), default_flow_style=False, sort_keys=False)
    return {key: [_Represented(n) for n in dumper.represent_data(list(values)).value] for key, values in edits.items()}


class CdiStore:
    """This driver's claim specs under the CDI root (other files there are never touched)."""

    def __init__(self, root: Path, driver_edits: Mapping[str, Any] | None = None) -> None:
        self.root = Path(root)
        self.driver_edits = driver_edits or {}  # agent.driver.edits, built once at start-up, added to every spec
        self._driver_written = _represented(self.driver_edits)

    def path(self, claim_uid: str) -> Path:
        if problem := uid_problem(claim_uid):  # callers check first; this keeps a bad UID out of any path
            raise ValueError(problem)
        return self.root / spec_file_name(claim_uid)

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(claim_uid)
        # Not durable: the checkpoint keeps every spec and recovery rewrites a missing one, a power loss voids
        # the claim anyway (new boot id), and on nodes the CDI root (/var/run/cdi) is tmpfs.
        doc = with_driver_edits(spec, self.driver_edits, self._driver_written)
        text = yaml.dump(doc, Dumper=_SpecDumper, sort_keys=False)
        files.write_atomic(path, text.encode(), durable=False)
        return path

    def remove(self, claim_uid: str) -> bool:
        return files.remove(self.path(claim_uid))

    def exists(self, claim_uid: str) -> bool:
        return self.path(claim_uid).is_file()

    def claim_uids(self) -> set[str]:
        """Claims with a spec file here. Something else under a spec's name (a directory) is not this
        driver's to remove: it is skipped, with a warning."""
        if not self.root.is_dir():
            return set()
        uids = set()
        for path in self.root.iterdir():
            if (m := _FILE.match(path.name)) is None:
                continue
            if not path.is_file() or path.is_symlink():
                log.warning("skipping %s: not a CDI spec file", path)
                continue
            uids.add(m.group(1))
        return uids

    def leftover_temps(self) -> list[Path]:
        return files.leftover_temps(self.root, _FILE_PREFIX)
