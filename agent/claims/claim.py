"""Reading a ResourceClaim (API JSON) for prepare: is it the claim the kubelet meant, is it allocated, and
which of its results belong to this driver on this node. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.claimconfig.config import ConfigEntry, ConfigError, parse_allocation_configs
from agent.claims.types import ClaimRef


class ClaimError(Exception):
    """This claim cannot be prepared; the message is what the kubelet shows the user."""


@dataclass(frozen=True)
class AllocatedDevice:
    """One allocation result of this driver and pool."""

    request: str  # may be `request/subrequest`
    device: str
    admin_access: bool = False
    share_id: str = ""
    consumed: tuple[tuple[str, str], ...] = ()  # a share's consumedCapacity (name, quantity)

    @property
    def base_request(self) -> str:
        # The kubelet matches containers by base request name, so prepare reports those.
        return self.request.split("/", 1)[0]


@dataclass(frozen=True)
class NodeAllocation:
    results: tuple[AllocatedDevice, ...]
    configs: tuple[ConfigEntry, ...]


def node_allocation(claim: Mapping[str, Any], ref: ClaimRef, driver: str, pool: str) -> NodeAllocation:
    """The part of `claim`'s allocation this node's driver prepares, or a ClaimError saying why none."""
    what = f"ResourceClaim {ref.namespace}/{ref.name}"
    try:
        return _node_allocation(claim, ref, driver, pool, what)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:  # a shape the API would not serve
        raise ClaimError(f"{what} has a malformed allocation ({type(exc).__name__}: {str(exc)[:100]})") from None


def _node_allocation(claim: Mapping[str, Any], ref: ClaimRef, driver: str, pool: str, what: str) -> NodeAllocation:
    uid = (claim.get("metadata") or {}).get("uid")
    if uid != ref.uid:
        raise ClaimError(f"{what} has UID {uid}, not {ref.uid}: the claim was deleted and recreated")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"{what} is not allocated")
    devices = allocation.get("devices") or {}
    raw_results: Sequence[Mapping[str, Any]] = devices.get("results") or ()
    results = tuple(
        AllocatedDevice(
            request=_text(r["request"], "request"),
            device=_text(r["device"], "device"),
            admin_access=bool(r.get("adminAccess") or False),
            share_id=str(r.get("shareID") or ""),
            consumed=tuple(sorted((str(k), str(v)) for k, v in (r.get("consumedCapacity") or {}).items())),
        )
        for r in raw_results
        if r.get("driver") == driver and r.get("pool") == pool
    )
    if not results:
        elsewhere = ", ".join(f"{r.get('driver')}/{r.get('pool')}/{r.get('device')}" for r in raw_results)
        raise ClaimError(
            f"{what} has no device of driver {driver} in pool {pool}"
            + (f" (it was allocated {elsewhere})" if elsewhere else "")
        )
    try:
        raw_configs = devices.get("config") or ()
        configs = parse_allocation_configs(raw_configs, driver)
        _check_config_requests(raw_configs, driver, claim)
    except ConfigError as exc:
        raise ClaimError(f"{what}: bad device config: {exc}") from None
    return NodeAllocation(results, tuple(configs))


def _check_config_requests(configs: Sequence[Mapping[str, Any]], driver: str, claim: Mapping[str, Any]) -> None:
    """A config of this driver naming a request the claim does not have would be silently ignored (NVIDIA's
    driver skips it): the user meant some device to be configured, so it is this claim's error."""
    requests = ((claim.get("spec") or {}).get("devices") or {}).get("requests")
    if not isinstance(requests, list):
        return  # no spec to compare with
    known = set()
    for r in requests:
        known.add(str(r.get("name")))
        known.update(f"{r.get('name')}/{sub.get('name')}" for sub in r.get("firstAvailable") or ())
    for i, item in enumerate(configs):
        if (item.get("opaque") or {}).get("driver") != driver:
            continue
        for name in item.get("requests") or ():
            if name not in known:
                raise ConfigError(
                    f"config[{i}] names request {name!r}, which the claim does not have "
                    f"(its requests: {', '.join(sorted(known)) or 'none'})"
                )


def _text(value: object, field: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{field} {value!r:.40} is not a string")
    return value
