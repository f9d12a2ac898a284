"""IMEX channels and the daemon device as the node publishes and prepares them, without I/O.

Each node in a fabric clique publishes, in its own pool, the devices NVIDIA's compute-domain plugin publishes:
`channel-0` (type channel, id 0) and `daemon-0` (type daemon, id 0). A claim of channel-0 gets one IMEX channel,
`/dev/nvidia-caps-imex-channels/channel0`; with the ComputeDomain's allocationMode All, every channel of the node.
The channel devices' major number is the kernel's for `nvidia-caps-imex-channels` in /proc/devices; the minor is
the channel number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.computedomain.model import ALL, API_VERSION, DRIVER, SINGLE
from agent.devices.model import FabricInfo
from agent.jsontypes import Json

CHANNEL, DAEMON = "channel", "daemon"
CLIQUE_ATTRIBUTE = "cliqueID"
CHANNEL_DEVICE, DAEMON_DEVICE = "channel-0", "daemon-0"
CHANNELS_DIR = "/dev/nvidia-caps-imex-channels"
PROC_DEVICES_NAME = "nvidia-caps-imex-channels"
DEFAULT_CHANNEL_COUNT = 2048  # what NVIDIA's driver assumes (NVreg_ImexChannelCount's default)
CHANNEL_CONFIG, DAEMON_CONFIG = "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig"
CDI_VENDOR = f"k8s.{DRIVER}"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"


class ConfigError(ValueError):
    """A claim's compute-domain config is not one this driver accepts; the message is the claim's error."""


def channel_path(channel: int) -> str:
    return f"{CHANNELS_DIR}/channel{channel}"


def device_type(device_name: str) -> str | None:
    return {CHANNEL_DEVICE: CHANNEL, DAEMON_DEVICE: DAEMON}.get(device_name)


def slice_devices(clique_id: str) -> list[Json]:
    """The devices of a node in a fabric clique, as resource.k8s.io/v1 ResourceSlice devices: NVIDIA's `type` and
    `id`, and the clique (`<clusterUUID>.<cliqueId>`), which a claim's CEL selector can name and by which the
    arbiter keeps a domain's gang inside one clique."""
    return [
        {
            "name": name,
            "attributes": {"type": {"string": kind}, "id": {"int": 0}, CLIQUE_ATTRIBUTE: {"string": clique_id}},
        }
        for name, kind in ((CHANNEL_DEVICE, CHANNEL), (DAEMON_DEVICE, DAEMON))
    ]


def resource_slice(node_name: str, node_uid: str | None, generation: int, clique_id: str) -> Json:
    meta: Json = {"name": f"{node_name}-{DRIVER}"}
    if node_uid:
        meta["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
        ]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": meta,
        "spec": {
            "driver": DRIVER,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": slice_devices(clique_id),
        },
    }


def imex_channels_major(proc_devices: str) -> int | None:
    """The character-device major of IMEX channels from /proc/devices' text (None: the module did not register
    them, e.g. a driver without IMEX)."""
    in_char = False
    for line in proc_devices.splitlines():
        text = line.strip()
        if text.endswith("devices:"):
            in_char = text == "Character devices:"
            continue
        number, _, name = text.partition(" ")
        if in_char and name.strip() == PROC_DEVICES_NAME and number.isdigit():
            return int(number)
    return None


# --- opaque configs -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelConfig:
    domain_id: str
    allocation_mode: str = SINGLE


@dataclass(frozen=True)
class DaemonConfig:
    domain_id: str


DeviceConfig = ChannelConfig | DaemonConfig


def decode_config(params: Mapping[str, Any]) -> DeviceConfig:
    """A ComputeDomainChannelConfig or ComputeDomainDaemonConfig, decoded strictly (unknown fields are errors)."""
    if params.get("apiVersion") != API_VERSION:
        raise ConfigError(f"config apiVersion must be {API_VERSION}, not {params.get('apiVersion')!r}")
    kind = params.get("kind")
    allowed = {"apiVersion", "kind", "domainID"} | ({"allocationMode"} if kind == CHANNEL_CONFIG else set())
    if kind not in (CHANNEL_CONFIG, DAEMON_CONFIG):
        raise ConfigError(f"config kind must be {CHANNEL_CONFIG} or {DAEMON_CONFIG}, not {kind!r}")
    if unknown := sorted(set(params) - allowed):
        raise ConfigError(f"{kind}: unknown field(s) {', '.join(unknown)}")
    domain = params.get("domainID")
    if not isinstance(domain, str) or not domain:
        raise ConfigError(f"{kind}: domainID cannot be empty")
    if kind == DAEMON_CONFIG:
        return DaemonConfig(domain)
    mode = params.get("allocationMode") or SINGLE
    if mode not in (SINGLE, ALL):
        raise ConfigError(f"{kind}: allocationMode must be Single or All, not {mode!r}")
    return ChannelConfig(domain, mode)


def configs_by_request(allocation: Mapping[str, Any]) -> list[tuple[tuple[str, ...], DeviceConfig]]:
    """The claim's configs for this driver in precedence order (class configs, then the claim's: later wins)."""
    entries = (allocation.get("devices") or {}).get("config") or []
    ordered = sorted(entries, key=lambda c: 0 if c.get("source") == "FromClass" else 1)
    out = []
    for entry in ordered:
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping) or opaque.get("driver") != DRIVER:
            continue
        out.append((tuple(entry.get("requests") or ()), decode_config(opaque.get("parameters") or {})))
    return out


def config_for(request: str, device_name: str, configs: Sequence[tuple[tuple[str, ...], DeviceConfig]]) -> DeviceConfig:
    """The config that applies to one allocated device: the last that names its request, or else the last for every
    request of the device's kind. A config of the other kind naming the request is an error, as in NVIDIA's."""
    kind = device_type(device_name)
    wanted = ChannelConfig if kind == CHANNEL else DaemonConfig
    for requests, config in reversed(configs):
        if request in requests:
            if not isinstance(config, wanted):
                given = CHANNEL_CONFIG if isinstance(config, ChannelConfig) else DAEMON_CONFIG
                raise ConfigError(f"cannot apply {given} to request {request!r} ({device_name})")
            return config
        if not requests and isinstance(config, wanted):
            return config
    missing = CHANNEL_CONFIG if kind == CHANNEL else DAEMON_CONFIG
    raise ConfigError(
        f"request {request!r} ({device_name}) has no {missing} naming its ComputeDomain (domainID); "
        "claims come from the domain's ResourceClaimTemplate"
    )


# --- CDI ----------------------------------------------------------------------------------------------------


def cdi_device_id(claim_uid: str, device_name: str) -> str:
    return f"{CDI_KIND}={claim_uid}-{device_name}"


def channel_node(channel: int, major: int, dev_root: str) -> Json:
    """A CDI device node for one channel; type and numbers given, so the runtime needs no host node to copy."""
    path = channel_path(channel)
    node: Json = {"path": path, "type": "c", "major": major, "minor": channel, "fileMode": 0o666}
    if dev_root not in ("", "/"):
        node["hostPath"] = dev_root.rstrip("/") + path
    return node


def claim_spec(
    claim_uid: str, devices: Mapping[str, Sequence[int]], major: int, dev_root: str, env: Mapping[str, str]
) -> Json:
    """One claim's CDI spec: per device, its channels' device nodes (none for the daemon device) and `env`. The
    spec store (agent.claims.cdi.CdiStore) gives it the cdiVersion its fields need as it writes it."""
    env_list = [f"{k}={v}" for k, v in {"NVIDIA_VISIBLE_DEVICES": "void", **env}.items()]
    return {
        "kind": CDI_KIND,
        "devices": [
            {
                "name": f"{claim_uid}-{name}",
                "containerEdits": {
                    "env": env_list,
                    "deviceNodes": [channel_node(c, major, dev_root) for c in channels],
                },
            }
            for name, channels in devices.items()
        ],
    }


def channels_for(config: ChannelConfig, channel_count: int) -> tuple[int, ...]:
    return tuple(range(channel_count)) if config.allocation_mode == ALL else (0,)


def node_clique(fabrics: Sequence[FabricInfo | None]) -> str | None:
    """The clique whose IMEX channels the node offers, from its GPUs' fabric (None: a GPU not registered with the
    fabric manager, state not COMPLETED): none while any GPU reports a degraded bandwidth either."""
    return clique_of([f.domain_id if f is not None and not f.degraded else None for f in fabrics])


def clique_of(fabrics: Sequence[str | None]) -> str | None:
    """The node's fabric clique from its GPUs' (`<clusterUuid>.<cliqueId>`, None for a GPU not attached): only
    when every GPU is attached and all name the same clique; otherwise the node serves no IMEX channels."""
    if not fabrics or any(f is None for f in fabrics) or len(set(fabrics)) != 1:
        return None
    return fabrics[0]
