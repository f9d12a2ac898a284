"""What the API's objects say, read from their JSON as the informers hold it: pods, ResourceClaims,
ResourceSlices and Nodes. Pure: no I/O, no clock.

Beneath both the node side and the arbiter: the arbiter's snapshot (agent.arbiter.world) and commit, the node's
reservation service (agent.reservation.node_service), the node agent's absent-arbiter teller and the fakes
read the objects here, so each question about an object has one answer. Writing objects back is
agent.objects.write.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

from agent.devices.shares import Capacity
from agent.names import GATE, GPU_CLASS, MIG_CLASS
from agent.quantity import QuantityError, parse

# a node that reports none of its standard resources is not limited by them (extended resources: it has none)
_UNREPORTED = {"cpu": 1e12, "memory": 1e18, "pods": 1e12, "ephemeral-storage": 1e18}
EXTENDED_RESOURCE = "nvidia.com/gpu"  # DRAExtendedResource: kube-scheduler would allocate it through our class


# --- any object; pods ------------------------------------------------------------------------------------


def meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def pod_key(pod: Mapping[str, Any]) -> str:
    m = meta(pod)
    return f"{m.get('namespace', '')}/{m.get('name', '')}"


def is_gated(pod: Mapping[str, Any]) -> bool:
    return any(g.get("name") == GATE for g in (pod.get("spec") or {}).get("schedulingGates") or ())


def quantity(text: object, scale: float = 1.0) -> float:
    return _quantity_value(str(text)) * scale


@functools.lru_cache(maxsize=4096)
def _quantity_value(text: str) -> float:
    """Parsed once per distinct string: a cluster's pods repeat a handful of requests ("4", "16Gi"), and parsing
    them again for every pod in every snapshot was a tenth of the arbiter's time."""
    try:
        return float(parse(text).value)
    except QuantityError:
        return 0.0


def claim_names(pod: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The pod's ResourceClaim names, and the names of its pod-level claims whose generated claim does not
    exist yet (kube-controller-manager creates claims from templates and records them in the pod status)."""
    spec = pod.get("spec") or {}
    statuses = {
        s.get("name"): s.get("resourceClaimName") for s in (pod.get("status") or {}).get("resourceClaimStatuses") or ()
    }
    names, missing = [], []
    for rc in spec.get("resourceClaims") or ():
        if rc.get("resourceClaimName"):
            names.append(str(rc["resourceClaimName"]))
        elif rc.get("resourceClaimTemplateName"):
            generated = statuses.get(rc.get("name"))
            if generated:
                names.append(str(generated))
            else:
                missing.append(str(rc.get("name")))
    return names, missing


# --- ResourceClaims: their allocation -------------------------------------------------------------------


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The node a claim's allocation is bound to (the metadata.name its nodeSelector names), if any."""
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}
    for term in selector.get("nodeSelectorTerms") or ():
        for req in term.get("matchFields") or ():
            if req.get("key") == "metadata.name" and req.get("operator") == "In" and len(req.get("values") or ()) == 1:
                return str(req["values"][0])
    return None


def reserved_for(claim: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    uid = meta(pod).get("uid")
    return any(r.get("uid") == uid for r in (claim.get("status") or {}).get("reservedFor") or ())


def is_allocated(claim: Mapping[str, Any]) -> bool:
    return bool((claim.get("status") or {}).get("allocation"))


def awaits_placement(pod: Mapping[str, Any]) -> bool:
    """Pending, on no node and not being deleted: a pod some scheduler has yet to place."""
    return (
        not meta(pod).get("deletionTimestamp")
        and not (pod.get("spec") or {}).get("nodeName")
        and (pod.get("status") or {}).get("phase") in (None, "Pending")
    )


def wants_our_devices(claims: Iterable[Mapping[str, Any] | None]) -> bool:
    """Whether any of a pod's claims (None: not found) is of our classes and allocated by nobody yet: behind the
    arbiter's fence only the arbiter can allocate it."""
    return any(c is not None and not is_allocated(c) and claim_is_ours(c) for c in claims)


def claim_is_ours(claim: Mapping[str, Any]) -> bool:
    """Whether any request of the claim (a firstAvailable one: any of its subrequests) names one of our classes."""
    for r in ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ():
        for sub in (r.get("exactly") or {}, *(r.get("firstAvailable") or ())):
            if sub.get("deviceClassName") in (GPU_CLASS, MIG_CLASS):
                return True
    return False


def asks_extended_gpus(pod: Mapping[str, Any]) -> bool:
    """Whether a container asks for `nvidia.com/gpu`, which kube-scheduler turns into a claim of our class."""
    spec = pod.get("spec") or {}
    for c in (*(spec.get("containers") or ()), *(spec.get("initContainers") or ())):
        res = c.get("resources") or {}
        if EXTENDED_RESOURCE in (res.get("requests") or {}) or EXTENDED_RESOURCE in (res.get("limits") or {}):
            return True
    return False


def allocated_devices(claim: Mapping[str, Any], driver: str, *, shares: bool = True) -> list[tuple[str, str]]:
    """(pool, device) of each of our driver's devices in the claim's allocation (without `shares`: only those
    the claim holds whole, not its consumable-capacity shares)."""
    return [
        (str(r.get("pool")), str(r.get("device")))
        for r in allocation_results(claim)
        if r.get("driver") == driver and (shares or not r.get("shareID"))
    ]


def allocation_results(claim: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    return (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ()


def allocated_shares(claim: Mapping[str, Any], driver: str) -> list[tuple[str, str, Mapping[str, Any]]]:
    """(pool, device, consumedCapacity) of each consumable-capacity share of our driver in the allocation."""
    return [
        (str(r.get("pool")), str(r.get("device")), r.get("consumedCapacity") or {})
        for r in allocation_results(claim)
        if r.get("driver") == driver and r.get("shareID")
    ]


# --- ResourceClaims: their requests, and the firstAvailable subrequests a claim may be allocated with --------


Choice = tuple[int, ...]  # for each request of a claim, the index of its firstAvailable subrequest (0 otherwise)
MAX_CHOICES = 64  # combinations of subrequests tried per claim; beyond them, the claim takes its first fitting one


def request_options(request: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any] | None]]:
    """What a request may be satisfied by, in order: its `exactly`, or each firstAvailable subrequest, named
    `request/subrequest` as allocation results name it. [(name, None)]: it has neither."""
    name = str(request.get("name"))
    if request.get("exactly") is None and request.get("firstAvailable"):
        return [(f"{name}/{sub.get('name')}", sub) for sub in request["firstAvailable"]]
    return [(name, request.get("exactly"))]


def claim_requests(claim: Mapping[str, Any]) -> Sequence[Mapping[str, Any]]:
    return ((claim.get("spec") or {}).get("devices") or {}).get("requests") or ()


def choices(claim: Mapping[str, Any]) -> Iterator[Choice]:
    """The claim's combinations of subrequests in the order kube-scheduler's structured allocator tries them on a
    node: depth-first over the requests in order, each request's subrequests in order (the first request's choice
    changes last), at most MAX_CHOICES of them."""
    sizes = [len(request_options(r)) for r in claim_requests(claim)]
    choice = [0] * len(sizes)
    for _ in range(MAX_CHOICES):
        yield tuple(choice)
        i = len(sizes) - 1
        while i >= 0 and choice[i] + 1 >= sizes[i]:
            choice[i] = 0
            i -= 1
        if i < 0:
            return
        choice[i] += 1


def chosen_requests(
    claim: Mapping[str, Any], choice: Choice | None = None
) -> Iterator[tuple[str, Mapping[str, Any] | None]]:
    """(name, the `exactly` or subrequest chosen) of each request of the claim; without a `choice`, each
    request's first. None: the request has neither."""
    for i, r in enumerate(claim_requests(claim)):
        options = request_options(r)
        pick = choice[i] if choice is not None and i < len(choice) and choice[i] < len(options) else 0
        yield options[pick]


# --- ResourceSlices --------------------------------------------------------------------------------------


ShareDevices = Mapping[tuple[str, str], Mapping[str, Capacity]]  # (pool, device) -> capacities, shareable ones


def share_devices(slices: Iterable[Mapping[str, Any]], driver: str) -> dict[tuple[str, str], dict[str, Capacity]]:
    """(pool, device) -> the capacities, with their request policies, of each device of our driver published
    with allowMultipleAllocations (unreadable capacities leave the device out)."""
    out: dict[tuple[str, str], dict[str, Capacity]] = {}
    for _spec, key, d in published_devices(slices, driver):
        if d.get("allowMultipleAllocations") is True:
            try:
                out[key] = {str(k): Capacity.from_json(v or {}) for k, v in (d.get("capacity") or {}).items()}
            except (QuantityError, AttributeError):
                continue
    return out


def share_gpus(consumed: Mapping[str, Any], capacity: Mapping[str, float] | None) -> float:
    """What a share is worth in GPUs: the largest part it takes of any of the device's capacities (memory for
    `memory: 8Gi`, one of N for `--consumable-shares=N`); 1 when the device is not published (any more)."""
    if not capacity:
        return 1.0
    parts = [quantity(v) / capacity[k] for k, v in consumed.items() if capacity.get(k)]
    return min(1.0, max(parts, default=1.0))


def pool_of(spec: Mapping[str, Any]) -> tuple[str, int]:
    """A slice's pool: its name and generation."""
    pool = spec.get("pool") or {}
    return str(pool.get("name")), int(pool.get("generation") or 0)


def published_devices(
    slices: Iterable[Mapping[str, Any]], driver: str
) -> Iterator[tuple[Mapping[str, Any], tuple[str, str], Mapping[str, Any]]]:
    """(slice spec, (pool, device name), device) of each device `driver`'s slices publish."""
    for s in slices:
        spec = s.get("spec") or {}
        if spec.get("driver") != driver:
            continue
        pool = pool_of(spec)[0]
        for d in spec.get("devices") or ():
            yield spec, (pool, str(d.get("name"))), d


def device_type(device: Mapping[str, Any]) -> object:
    """A published device's `type` attribute: gpu or mig."""
    return ((device.get("attributes") or {}).get("type") or {}).get("string")


# --- read once per version of an object ------------------------------------------------------------------


# Values read from one version of an object, by (uid, resourceVersion): a version never changes, and reading
# every pod and pending claim again in every snapshot was most of the snapshot's time. Forgotten all at once
# beyond _MEMO_MAX entries (the next snapshots fill it again); objects without both are read every time.
_MEMO: dict[tuple[str, str, str], Any] = {}
_MEMO_MAX = 200_000
T = TypeVar("T")


def memo(kind: str, obj: Mapping[str, Any], read: Callable[[Mapping[str, Any]], T]) -> T:
    """`read(obj)`, remembered as `kind` for this version of `obj`."""
    m = meta(obj)
    uid, version = m.get("uid"), m.get("resourceVersion")
    if not uid or not version:
        return read(obj)
    key = (kind, str(uid), str(version))
    if key in _MEMO:
        return cast(T, _MEMO[key])
    value = read(obj)  # an exception is raised, not remembered
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    _MEMO[key] = value
    return value


# --- nodes and what pods ask of them -----------------------------------------------------------------------


def allocatable(node: Mapping[str, Any]) -> dict[str, float]:
    """What the node offers its pods, in pod_requests' units."""
    return {**_UNREPORTED, **_amounts((node.get("status") or {}).get("allocatable"))}


def pod_requests(pod: Mapping[str, Any]) -> Mapping[str, float]:
    """What the pod asks of its node (read once per version of the pod), counted as kube-scheduler's
    NodeResourcesFit counts it (k8s.io/component-helpers resource.PodRequests): its containers' sum with the
    sidecars (init containers that restart Always) added, and never less than any init container's peak (it plus
    the sidecars started before it); pod-level requests where the pod sets them (CPU, memory, hugepages); plus the
    RuntimeClass overhead; and one of the node's `pods`. Counting only the containers, a node could look roomier
    than kube-scheduler sees it, and a pod admitted there never bound."""
    return memo("requests", pod, _read_requests)


def _read_requests(pod: Mapping[str, Any]) -> dict[str, float]:
    spec = pod.get("spec") or {}
    total: dict[str, float] = {}
    for c in spec.get("containers") or ():
        add_amounts(total, _amounts((c.get("resources") or {}).get("requests")))
    sidecars: dict[str, float] = {}
    peak: dict[str, float] = {}
    for c in spec.get("initContainers") or ():
        asked = _amounts((c.get("resources") or {}).get("requests"))
        if c.get("restartPolicy") == "Always":  # a sidecar: it keeps running beside whatever starts after it
            add_amounts(total, asked)
            add_amounts(sidecars, asked)
            _at_least(peak, sidecars)
        else:
            add_amounts(asked, sidecars)
            _at_least(peak, asked)
    _at_least(total, peak)
    pod_level = _amounts((spec.get("resources") or {}).get("requests"))
    total.update({k: v for k, v in pod_level.items() if k in ("cpu", "memory") or k.startswith("hugepages-")})
    add_amounts(total, _amounts(spec.get("overhead")))
    total["pods"] = 1.0
    return total


def _amounts(resources: Mapping[str, Any] | None) -> dict[str, float]:
    """A resource list in numbers: CPU in milli-CPUs, every other resource in its unit (bytes, a count)."""
    return {name: quantity(q, 1000.0 if name == "cpu" else 1.0) for name, q in (resources or {}).items()}


def add_amounts(total: dict[str, float], more: Mapping[str, float]) -> None:
    for name, amount in more.items():
        total[name] = total.get(name, 0.0) + amount


def _at_least(total: dict[str, float], floor: Mapping[str, float]) -> None:
    for name, amount in floor.items():
        total[name] = max(total.get(name, 0.0), amount)
