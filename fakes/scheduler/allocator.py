"""kube-scheduler's structured DRA allocation, small: pick devices for one ResourceClaim, build status.allocation.

Semantics follow k8s.io/dynamic-resource-allocation/structured: only the newest generation of each pool
counts; a device is selectable when every DeviceClass selector and then every request selector holds;
devices in other claims' allocations are taken (admin-access results excepted); all devices of a claim sit
on one node; `matchAttribute` constraints need one typed value across the devices of the named requests, so
the search backtracks. Requests are `exactly` or `firstAvailable` (first alternative that fits wins).
Consumable capacity (DRAConsumableCapacity): a device with `allowMultipleAllocations` is never taken by a
claim; each allocation of it is a share with a fresh `shareID` and the `consumedCapacity` its request rounds
to under the device's request policies (agent.devices.shares), and shares never consume more than the device
has; a request's `capacity.requests` must also fit an exclusive device's capacity.
Pure apart from the random shareID: claims, slices and classes come in as API JSON dicts; the allocation goes
out as one.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.allocation.cel import DeviceSelector, SelectorError, device_variable
from agent.arbiter.node_rules import tolerates
from agent.devices import shares
from agent.jsontypes import Json
from agent.objects.read import Choice, claim_requests, request_options
from agent.objects.write import device_config

# The allocator gives up after this many placement attempts rather than search forever (kube-scheduler
# bounds the same search with a time limit).
MAX_STEPS = 200_000


class Unsatisfiable(Exception):
    """No devices satisfy the claim; the message says which request or constraint could not be met.

    `in_use`: the claim would fit if other claims released their devices, so it is worth retrying later.
    """

    def __init__(self, message: str, *, in_use: bool = False) -> None:
        super().__init__(message)
        self.in_use = in_use


@dataclass(frozen=True)
class Candidate:
    """A published device and where it lives."""

    driver: str
    pool: str
    device: Mapping[str, Any]
    location: str  # JSON of the node selector, "" for devices usable on all nodes

    @property
    def name(self) -> str:
        return str(self.device["name"])

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.name)

    @functools.cached_property
    def variable(self) -> Json:
        """The CEL `device` selectors see, built once however many requests and nodes look at the device."""
        return device_variable(self.driver, self.device)

    @property
    def shareable(self) -> bool:
        return self.device.get("allowMultipleAllocations") is True

    @functools.cached_property
    def capacities(self) -> dict[str, shares.Capacity]:
        return {str(k): shares.Capacity.from_json(v) for k, v in (self.device.get("capacity") or {}).items()}

    def attribute(self, qualified: str) -> Any:
        """A fully-qualified attribute's typed value ({"string": ...}), None when absent."""
        domain, _, name = qualified.rpartition("/")
        attributes = self.device.get("attributes") or {}
        value = attributes.get(qualified)
        if value is None and domain == self.driver:
            value = attributes.get(name)  # unprefixed names are in the driver's domain
        return None if value is None else json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class Alternative:
    """One way to satisfy a request: the `exactly` of a request, or one of its `firstAvailable` entries."""

    result_name: str  # "req" or "req/sub", as written in results
    class_name: str
    selectors: tuple[DeviceSelector, ...]  # class selectors first, then the request's
    count: int | None  # None: allocationMode All
    admin_access: bool
    tolerations: tuple[Mapping[str, Any], ...] = ()
    capacity: tuple[tuple[str, Any], ...] = ()  # capacity.requests: (name, exact value)

    def share(self, device: Candidate) -> dict[str, Any] | None:
        """What one allocation of `device` for this request consumes, None when the device cannot serve it.
        An exclusive device consumes nothing that others count; its capacity must still cover the request."""
        requests = dict(self.capacity)
        if device.shareable:
            return shares.share_of(requests, device.capacities)
        if any(
            name not in device.capacities or value > device.capacities[name].value for name, value in requests.items()
        ):
            return None
        return {}


@dataclass
class _Search:
    requests: list[tuple[str, list[tuple[Alternative, list[Candidate]]]]]
    constraints: list[tuple[frozenset[str], str]]
    chosen: list[tuple[Alternative, Candidate]] = field(default_factory=list)
    steps: int = 0
    consumed: Mapping[tuple[str, str, str], list[dict[str, Any]]] = field(default_factory=dict)  # other claims'


def allocate(
    claim: Mapping[str, Any],
    slices: Iterable[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]] = (),
    *,
    node: str | None = None,
) -> Json:
    """The `status.allocation` for `claim`, or Unsatisfiable. `claims` are all claims (to skip taken devices);
    `node` limits the search to one node, as when kube-scheduler filters a node for a pod."""
    spec = claim.get("spec", {}).get("devices", {})
    slices, classes = list(slices), list(classes)
    by_class = {c["metadata"]["name"]: c for c in classes}
    uid = claim.get("metadata", {}).get("uid")
    others = [c for c in claims if c.get("metadata", {}).get("uid") != uid]
    taken, consumed = _taken(others), _consumed(others)
    devices = [c for c in _current_devices(slices) if node is None or c.location in ("", _node_location(node))]
    requests = [(r["name"], _alternatives(r, by_class)) for r in spec.get("requests", [])]
    if not requests:
        raise Unsatisfiable("the claim has no device requests")
    constraints = [(frozenset(c.get("requests") or ()), c["matchAttribute"]) for c in spec.get("constraints", [])]
    if any("distinctAttribute" in c for c in spec.get("constraints", [])):
        raise Unsatisfiable("distinctAttribute constraints are not supported by this allocator")

    failures: list[str] = []
    for location in sorted({d.location for d in devices if d.location}) or [""]:
        here = [d for d in devices if d.location in ("", location)]
        search = _Search(
            [(name, [(a, _selectable(a, here, taken, consumed)) for a in alts]) for name, alts in requests],
            constraints,
            consumed=consumed,
        )
        if _place(search, 0):
            return _allocation(claim, search.chosen, by_class, location)
        failures.append(_explain(search, location))
    in_use = bool(taken or consumed) and _fits_when_free(claim, slices, classes, node)
    reason = "; ".join(failures) if failures else "no devices are published"
    raise Unsatisfiable(reason + (" (devices are in use by other claims)" if in_use else ""), in_use=in_use)


def _fits_when_free(
    claim: Mapping[str, Any],
    slices: Sequence[Mapping[str, Any]],
    classes: Iterable[Mapping[str, Any]],
    node: str | None,
) -> bool:
    try:
        allocate(claim, slices, classes, (), node=node)
    except Unsatisfiable:
        return False
    return True


def _alternatives(request: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]) -> list[Alternative]:
    name = request["name"]
    if "exactly" in request:
        entries = [(name, request["exactly"])]
    elif "firstAvailable" in request:
        entries = [(f"{name}/{sub['name']}", sub) for sub in request["firstAvailable"]]
    else:
        raise Unsatisfiable(f"request {name!r} has neither exactly nor firstAvailable")
    alternatives = []
    for result_name, e in entries:
        device_class = classes.get(e.get("deviceClassName", ""))
        if device_class is None:
            raise Unsatisfiable(f"request {result_name!r}: DeviceClass {e.get('deviceClassName')!r} does not exist")
        expressions = [
            s["cel"]["expression"]
            for s in [*device_class.get("spec", {}).get("selectors", []), *e.get("selectors", [])]
        ]
        mode = e.get("allocationMode", "ExactCount")
        if mode not in ("ExactCount", "All"):
            raise Unsatisfiable(f"request {result_name!r}: unknown allocationMode {mode!r}")
        alternatives.append(
            Alternative(
                result_name,
                device_class["metadata"]["name"],
                tuple(DeviceSelector(x) for x in expressions),
                int(e.get("count", 1)) if mode == "ExactCount" else None,
                bool(e.get("adminAccess", False)),
                tuple(e.get("tolerations") or ()),
                tuple(_capacity_requests(e, result_name).items()),
            )
        )
    return alternatives


def _capacity_requests(entry: Mapping[str, Any], result_name: str) -> dict[str, Any]:
    try:
        return shares.requests_of(entry.get("capacity"))
    except shares.ShareError as exc:
        raise Unsatisfiable(f"request {result_name!r}: {exc}") from None


def _node_location(node: str) -> str:
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return json.dumps({"nodeSelectorTerms": [term]}, sort_keys=True)


def with_rule_taints(slices: Iterable[Mapping[str, Any]], rules: Iterable[Mapping[str, Any]]) -> list[Json]:
    """The slices with each DeviceTaintRule's taint added to the devices its selector picks (driver, pool,
    device; each set field must match), as kube-scheduler sees them (ListWithDeviceTaintRules)."""
    rules = [r for r in rules if (r.get("spec") or {}).get("taint")]
    if not rules:
        return [dict(s) for s in slices]
    out: list[Json] = []
    for s in slices:
        spec = s.get("spec") or {}
        devices = []
        for d in spec.get("devices") or ():
            taints = [
                rule["spec"]["taint"] for rule in rules if _rule_selects(rule["spec"].get("deviceSelector"), spec, d)
            ]
            devices.append({**d, "taints": [*(d.get("taints") or ()), *taints]} if taints else d)
        out.append({**s, "spec": {**spec, "devices": devices}})
    return out


def _rule_selects(selector: Mapping[str, Any] | None, spec: Mapping[str, Any], device: Mapping[str, Any]) -> bool:
    if selector is None:
        return False  # without a selector a rule matches no device
    wanted = (
        ("driver", spec.get("driver")),
        ("pool", (spec.get("pool") or {}).get("name")),
        ("device", device.get("name")),
    )
    return all(selector.get(k) in (None, v) for k, v in wanted)


def _current_devices(slices: Iterable[Mapping[str, Any]]) -> list[Candidate]:
    """Devices of the newest generation of every pool, in slice order."""
    slices = list(slices)
    newest: dict[tuple[str, str], int] = {}
    for s in slices:
        key = (s["spec"]["driver"], s["spec"]["pool"]["name"])
        newest[key] = max(newest.get(key, 0), int(s["spec"]["pool"]["generation"]))
    out: list[Candidate] = []
    for s in slices:
        spec = s["spec"]
        if int(spec["pool"]["generation"]) != newest[(spec["driver"], spec["pool"]["name"])]:
            continue
        if spec.get("nodeName"):
            location = _node_location(spec["nodeName"])
        elif spec.get("nodeSelector"):
            location = json.dumps(spec["nodeSelector"], sort_keys=True)
        else:
            location = ""  # allNodes
        out.extend(Candidate(spec["driver"], spec["pool"]["name"], d, location) for d in spec.get("devices", []))
    return out


def _results(claims: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for c in claims:
        yield from (c.get("status", {}).get("allocation") or {}).get("devices", {}).get("results", [])


def _taken(claims: Iterable[Mapping[str, Any]]) -> set[tuple[str, str, str]]:
    """Devices other claims hold whole (a share, with its shareID, holds only what it consumed)."""
    return {
        (r["driver"], r["pool"], r["device"])
        for r in _results(claims)
        if not r.get("adminAccess") and not r.get("shareID")
    }


def _consumed(claims: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """What other claims' shares consume of each shared device."""
    out: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in _results(claims):
        if r.get("shareID"):
            out.setdefault((r["driver"], r["pool"], r["device"]), []).append(
                shares.consumed_of(r.get("consumedCapacity"))
            )
    return out


def _selectable(
    alt: Alternative,
    devices: Sequence[Candidate],
    taken: set[tuple[str, str, str]],
    consumed: Mapping[tuple[str, str, str], list[dict[str, Any]]],
) -> list[Candidate]:
    """The devices this alternative may take: matching and free; for All, every match or none if one is taken."""
    matching = []
    for d in devices:
        if not _taints_tolerated(d.device.get("taints") or (), alt.tolerations):
            continue
        variable = d.variable
        try:
            if all(s.matches(variable) for s in alt.selectors):
                matching.append(d)
        except SelectorError as e:
            raise Unsatisfiable(f"request {alt.result_name!r}, device {d.name}: {e}") from None
    if alt.admin_access:
        return matching  # admin access may use devices that are in use
    matching = [d for d in matching if _has_room(alt, d, consumed.get(d.key, []))]
    if alt.count is None and any(d.key in taken for d in matching):
        return []
    return [d for d in matching if d.key not in taken]


def _has_room(alt: Alternative, device: Candidate, taken: Sequence[Mapping[str, Any]]) -> bool:
    share = alt.share(device)
    return share is not None and (not device.shareable or shares.fits(share, device.capacities, taken))


def _taints_tolerated(taints: Iterable[Mapping[str, Any]], tolerations: Sequence[Mapping[str, Any]]) -> bool:
    """A device with a NoSchedule or NoExecute taint is allocated only to a request tolerating it (effect None
    only informs), as the structured allocator does with DRADeviceTaints. A DeviceToleration matches as a pod's
    toleration does (resourceclaim.ToleratesTaint is a copy of core/v1's), so the arbiter's rule serves."""
    return all(
        t.get("effect") not in ("NoSchedule", "NoExecute") or any(tolerates(x, t) for x in tolerations) for t in taints
    )


def _place(search: _Search, index: int) -> bool:
    """Depth-first over requests (and their alternatives); True once every request has its devices."""
    if index == len(search.requests):
        return True
    _, alternatives = search.requests[index]
    for alt, candidates in alternatives:
        if alt.count is None:
            # All: every matching device, and at least one, or this alternative cannot be used.
            mark = len(search.chosen)
            if candidates and _try(search, alt, candidates):
                if _place(search, index + 1):
                    return True
                del search.chosen[mark:]
            continue
        if _choose(search, index, alt, candidates, 0, alt.count):
            return True
    return False


def _choose(search: _Search, index: int, alt: Alternative, candidates: list[Candidate], start: int, left: int) -> bool:
    """Pick `left` more devices from candidates[start:] (combinations, not permutations), then go on."""
    if left == 0:
        return _place(search, index + 1)
    for i in range(start, len(candidates) - left + 1):
        search.steps += 1
        if search.steps > MAX_STEPS:
            raise Unsatisfiable(f"gave up after {MAX_STEPS} placement attempts")
        if _try(search, alt, [candidates[i]]):
            if _choose(search, index, alt, candidates, i + 1, left - 1):
                return True
            search.chosen.pop()
    return False


def _try(search: _Search, alt: Alternative, devices: Sequence[Candidate]) -> bool:
    """Add devices when free in this claim and consistent with every constraint; leave chosen as it was if not."""
    in_claim = {c.key for _, c in search.chosen if not c.shareable}  # one claim may hold several shares
    exclusive = [d.key for d in devices if not d.shareable]
    if any(d.key in in_claim for d in devices) or len(set(exclusive)) < len(exclusive):
        return False
    trial = [*search.chosen, *((alt, d) for d in devices)]
    for d in {d.key: d for d in devices if d.shareable}.values():
        mine = [a.share(c) or {} for a, c in trial if c.key == d.key]
        if not shares.fits({}, d.capacities, [*search.consumed.get(d.key, []), *mine]):
            return False
    for requests, attribute in search.constraints:
        values = {d.attribute(attribute) for a, d in trial if _applies(requests, a.result_name)}
        if None in values or len(values) > 1:
            return False
    search.chosen[:] = trial
    return True


def _applies(requests: frozenset[str], result_name: str) -> bool:
    return not requests or result_name in requests or result_name.split("/", 1)[0] in requests


def _explain(search: _Search, location: str) -> str:
    where = f" on {_describe(location)}" if location else ""
    for name, alternatives in search.requests:
        for alt, candidates in alternatives:
            if (alt.count is None and candidates) or (alt.count is not None and len(candidates) >= alt.count):
                break
        else:
            wanted = ", ".join(
                f"{'all' if a.count is None else a.count} of class {a.class_name} ({len(c)} match and are free)"
                for a, c in alternatives
            )
            if all(not c for _, c in alternatives):
                return f"request {name!r}: no matching device{where} (wanted {wanted})"
            return f"request {name!r}: not enough matching devices{where} (wanted {wanted})"
    attributes = ", ".join(a for _, a in search.constraints)
    return f"no combination of free devices{where} satisfies the constraints ({attributes})"


def _describe(location: str) -> str:
    values = [
        v
        for term in json.loads(location).get("nodeSelectorTerms", [])
        for f in term.get("matchFields", [])
        for v in f.get("values", [])
    ]
    return f"node {values[0]}" if len(values) == 1 else location


def _allocation(
    claim: Mapping[str, Any],
    chosen: Sequence[tuple[Alternative, Candidate]],
    classes: Mapping[str, Mapping[str, Any]],
    location: str,
) -> Json:
    results = []
    for alt, d in chosen:
        result: Json = {"request": alt.result_name, "driver": d.driver, "pool": d.pool, "device": d.name}
        if alt.admin_access:
            result["adminAccess"] = True
        if d.shareable:
            result["shareID"] = str(uuid.uuid4())
            if consumed := alt.share(d):
                result["consumedCapacity"] = shares.to_quantities(consumed)
        results.append(result)
    devices: Json = {"results": results}
    config = device_config(claim, classes, _choice(claim, chosen))  # as the arbiter writes it, as upstream does
    if config:
        devices["config"] = config
    allocation: Json = {"devices": devices}
    if location:
        allocation["nodeSelector"] = json.loads(location)
    return allocation


def _choice(claim: Mapping[str, Any], chosen: Sequence[tuple[Alternative, Candidate]]) -> Choice:
    """For each request of the claim, the index of the alternative the search chose (as agent.objects.read
    numbers a firstAvailable request's subrequests)."""
    picked = {alt.result_name for alt, _ in chosen}
    return tuple(
        next((i for i, (name, _) in enumerate(request_options(r)) if name in picked), 0) for r in claim_requests(claim)
    )
