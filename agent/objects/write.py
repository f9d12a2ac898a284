"""What the arbiter makes of a ResourceClaim for others to act on: the request a node's local allocator
reserves devices for (`reservation_claim`), and the claim's `status.allocation` once a node has reserved them
(`allocation_status`), written as kube-scheduler writes it. Pure: no I/O, no clock (share ids come in).

`device_config` is the allocation's `devices.config` as kube-scheduler's structured allocator renders it; the
fake kube-scheduler (fakes/scheduler/allocator.py) renders its allocations with it too, so the tests' oracle and
the arbiter cannot drift apart. Reading objects is agent.objects.read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from agent.allocation.allocator import Claim, DeviceRequest
from agent.allocation.fragmentation import MILLI
from agent.devices.shares import Capacity, ShareError, describe, requests_of, share_of, to_quantities
from agent.jsontypes import Json
from agent.names import GPU_CLASS, MIG_CLASS
from agent.objects.read import Choice, ShareDevices, chosen_requests, claim_requests


class Unsupported(ValueError):
    """A claim the arbiter cannot reserve for; the message says which request and why."""


def share_part(requests: Mapping[str, Fraction], devices: Iterable[Mapping[str, Capacity]]) -> float | None:
    """The largest part of a GPU one share for `requests` (a request's `capacity.requests`) takes of any of
    `devices` (their capacities), consumed as upstream rounds it; None when none of them can serve it."""
    best: float | None = None
    for capacities in devices:
        taken = share_of(requests, capacities)
        if taken is None:
            continue
        part = max((float(v / capacities[k].value) for k, v in taken.items() if capacities[k].value), default=0.0)
        best = max(best or 0.0, min(1.0, part))
    return best


def share_milli(part: float) -> int:
    """A share's part of a GPU as the local allocator books it: rounded up (the node counts allocated shares
    the same way), at least one milli, and never the whole GPU (a fraction is 1..999)."""
    return min(MILLI - 1, max(1, math.ceil(part * MILLI)))


def share_requests(claim: Mapping[str, Any], choice: Choice | None = None) -> dict[str, dict[str, Fraction]]:
    """Request name (as reservation_claim names it) -> its `capacity.requests`, for the requests that ask for a
    share of a device (consumable capacity)."""
    out = {}
    for name, exact in chosen_requests(claim, choice):
        try:
            wanted = requests_of((exact or {}).get("capacity"))
        except ShareError as e:
            raise Unsupported(f"request {name!r}: {e}") from None
        if wanted:
            out[name] = wanted
    return out


def reservation_claim(
    claim: Mapping[str, Any], shareable: Iterable[Mapping[str, Capacity]] = (), choice: Choice | None = None
) -> Claim:
    """The allocator's view of a ResourceClaim's spec: `exactly` requests of our classes, ExactCount, with
    their CEL selectors; constraints that span the whole claim. A firstAvailable request takes the subrequest
    `choice` names (without one, its first), named `request/subrequest`.
    A request for consumable capacity becomes a GPU fraction: the part of a GPU its share takes of the
    `shareable` devices (their capacities) it may land on (the largest, so it fits wherever the node puts it)."""
    shareable = list(shareable)
    wanted = share_requests(claim, choice)
    devices = (claim.get("spec") or {}).get("devices") or {}
    requests = []
    for name, exact in chosen_requests(claim, choice):
        if exact is None:
            raise Unsupported(f"request {name!r} has neither exactly nor firstAvailable")
        klass = exact.get("deviceClassName")
        if klass not in (GPU_CLASS, MIG_CLASS):
            raise Unsupported(f"request {name!r} asks for device class {klass!r}")
        if (exact.get("allocationMode") or "ExactCount") != "ExactCount":
            raise Unsupported(f"request {name!r} uses allocationMode {exact.get('allocationMode')}")
        if exact.get("adminAccess"):
            raise Unsupported(f"request {name!r} asks for admin access")
        selectors = tuple(str(s["cel"]["expression"]) for s in exact.get("selectors") or () if s.get("cel"))
        milli = None
        if name in wanted:
            if klass != GPU_CLASS or int(exact.get("count") or 1) != 1:
                raise Unsupported(f"request {name!r}: a share (capacity.requests) is of one {GPU_CLASS} device")
            part = share_part(wanted[name], shareable)
            if part is None:
                raise Unsupported(
                    f"request {name!r}: no GPU published for sharing takes a share of {describe(wanted[name])}"
                )
            milli = share_milli(part)
        requests.append(DeviceRequest(name, klass, selectors, int(exact.get("count") or 1), milli))
    if not requests:
        raise Unsupported("the claim has no device requests")
    match: list[str] = []
    all_names = {r.name.split("/")[0] for r in requests}
    for c in devices.get("constraints") or ():
        attr = c.get("matchAttribute")
        if not attr:
            raise Unsupported("only matchAttribute constraints are handled")
        if set(c.get("requests") or all_names) != all_names:
            raise Unsupported(f"a matchAttribute constraint on {attr} covers only some requests")
        match.append(str(attr))
    return Claim(tuple(requests), tuple(match))


def allocation_status(
    claim: Mapping[str, Any],
    node: str,
    driver: str,
    devices: Mapping[str, Sequence[str]],
    classes: Mapping[str, Mapping[str, Any]],
    *,
    shareable: ShareDevices | None = None,
    share_id: Callable[[], str] | None = None,
    choice: Choice | None = None,
) -> Json:
    """`status.allocation` for devices a node reserved, as kube-scheduler writes it: results naming driver,
    pool (the node's pool is named after the node) and device; the configs (device_config);
    a nodeSelector for exactly that node. A request for consumable capacity gets a share: a fresh `shareID`
    (`share_id()`) and the `consumedCapacity` upstream's request policy rounds it to on that device
    (Unsupported when the device is not published for sharing, or cannot serve the share)."""
    wanted = share_requests(claim, choice)
    results: list[Json] = []
    for request, names in devices.items():
        for d in names:
            result: Json = {"request": request, "driver": driver, "pool": node, "device": d}
            if request in wanted:
                capacities = (shareable or {}).get((node, d))
                taken = share_of(wanted[request], capacities) if capacities is not None else None
                if taken is None or share_id is None:
                    raise Unsupported(
                        f"request {request!r}: device {d} of node {node} cannot take a share of "
                        f"{describe(wanted[request])}"
                    )
                result["shareID"] = share_id()
                if taken:
                    result["consumedCapacity"] = to_quantities(taken)
            results.append(result)
    config = device_config(claim, classes, choice)
    allocation: Json = {
        "devices": {"results": results},
        "nodeSelector": {
            "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]
        },
    }
    if config:
        allocation["devices"]["config"] = config
    return allocation


def device_config(
    claim: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]], choice: Choice | None = None
) -> list[Json]:
    """`status.allocation.devices.config` as kube-scheduler's structured allocator (1.37) writes it for a claim
    allocated with `choice` (its firstAvailable subrequests; without one, each request's first):
    - FromClass first: the configs of the class of each request's `exactly` or chosen subrequest, in request
      order, each class's configs once, naming every request that used the class (`request` or
      `request/subrequest`);
    - then FromClaim: each config of the claim, its `requests` as written, kept when it names no request (it
      applies to all), a request, or the subrequest chosen; a config for subrequests not chosen is dropped;
    - an entry whose requests cover every request of the claim names none (empty means all)."""
    chosen = list(chosen_requests(claim, choice))
    config: list[Json] = []
    of_class: dict[str, list[Json]] = {}  # class name -> its entries, written once
    for name, request in chosen:
        class_name = str((request or {}).get("deviceClassName"))
        klass = classes.get(class_name)
        if klass is None:
            continue
        if class_name in of_class:
            for entry in of_class[class_name]:
                entry["requests"].append(name)
            continue
        entries = [
            {"source": "FromClass", "requests": [name], **c} for c in (klass.get("spec") or {}).get("config") or ()
        ]
        of_class[class_name] = entries
        config.extend(entries)
    parents = [str(r.get("name")) for r in claim_requests(claim)]
    names = [(parent, name) for parent, (name, _) in zip(parents, chosen, strict=True)]  # request, what it chose
    named = set(parents) | {name for name, _ in chosen}
    for c in ((claim.get("spec") or {}).get("devices") or {}).get("config") or ():
        requests = c.get("requests") or ()
        if not requests or named.intersection(requests):
            config.append({"source": "FromClaim", **c})
    for entry in config:
        requests = entry.get("requests") or ()
        if not requests or all(parent in requests or name in requests for parent, name in names):
            entry.pop("requests", None)
    return config
