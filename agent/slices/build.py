"""ResourceSlices (resource.k8s.io/v1) from an Inventory: pure, plain dicts in API JSON shape.

Building is two steps so that "did anything change?" is a cheap comparison: `pool_content` turns the
inventory into the devices and counter sets the pool should hold (no names, no generation), and
`resource_slices` wraps that content into API objects for one pool generation.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.devices import deliverable, shares
from agent.devices.model import Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from agent.devices.names import gpu_device_name, mig_device_name
from agent.jsontypes import Json
from agent.quantity import format_bytes
from agent.slices.versions import LATEST, SliceRules

DEFAULT_DRIVER = "gpu.nvidia.com"
API_VERSION = "resource.k8s.io/v1"
MAX_DEVICES_PER_SLICE = LATEST.max_devices  # ResourceSliceMaxDevices, the same in every version
_MAX_NAME = 253
_PCI = "resource.kubernetes.io/"


@dataclass(frozen=True)
class SliceContent:
    """What one slice carries, without bookkeeping. Equal tuples of these mean nothing to publish."""

    devices: tuple[Json, ...]
    shared_counters: tuple[Json, ...] = ()


Taints = Mapping[str, Sequence[Json]]  # device name -> DeviceTaints (a GPU's also cover its MIG devices)


class SliceLimitExceeded(ValueError):
    """The pool cannot be published within the server version's ResourceSlice limits."""


def pool_content(
    inventory: Inventory,
    *,
    partitionable: bool = False,
    rules: SliceRules = LATEST,
    taints: Taints | None = None,
    share_mode: shares.ShareMode | None = None,
) -> tuple[SliceContent, ...]:
    """The pool's devices, grouped into slices the server version `rules` accepts, in a stable order.

    Without `partitionable`, a GPU whose MIG mode is on is represented only by its MIG devices. With it,
    every MIG-capable GPU gets a counter set that its whole-GPU device, its existing MIG devices and every
    still-possible MIG placement consume, so the scheduler can only pick combinations that fit; only the
    forms prepare can deliver are offered (agent.devices.deliverable). On 1.34 the counter set shares a slice
    with that GPU's devices, from 1.35 counter sets get slices of their own.
    `taints` are attached where the version serves device taints (the caller withdraws devices elsewhere).
    With `share_mode` (and a version that keeps consumable capacity), whole GPUs are published shareable:
    `allowMultipleAllocations` with the mode's capacities (agent.devices.shares); MIG devices stay exclusive.
    Attributes are unprefixed, i.e. in the driver's own domain, so the content is the same for any driver name.
    """
    taints = taints if rules.taints_served and taints else {}
    share_mode = share_mode if rules.shares_served else None
    plain: list[Json] = []
    partitioned: list[tuple[Json, list[Json]]] = []  # (counter set, devices) of each partitionable GPU
    for gpu in inventory.gpus:
        migs = inventory.mig_devices_of(gpu.minor)
        if partitionable and deliverable.offers_placements(gpu):
            counter_set, carved = _partitioned_gpu(inventory, gpu, migs, whole=deliverable.offers_whole_gpu(gpu))
            if carved:  # none when GPU instances without compute instances fill the GPU
                partitioned.append((counter_set, _with_taints(carved, gpu, taints, rules)))
            continue
        devices = [] if gpu.mig_enabled else [gpu_device(inventory, gpu, share_mode)]
        devices.extend(mig_device(inventory, gpu, m) for m in migs)
        plain.extend(_with_taints(devices, gpu, taints, rules))
    plain.sort(key=lambda d: natural_key(d["name"]))
    per_slice = rules.max_devices_advanced if any("taints" in d for d in plain) else rules.max_devices
    slices = [SliceContent(tuple(chunk)) for chunk in _chunks(plain, per_slice)]
    if rules.separate_counters:
        sets = [counter_set for counter_set, _ in partitioned]
        counter_slices = [SliceContent((), tuple(chunk)) for chunk in _chunks(sets, rules.max_counter_sets)]
        for counter_set, devices in partitioned:
            _check_counter_set(counter_set, rules.max_counters_per_set, rules)
            slices.extend(SliceContent(tuple(c)) for c in _chunks(devices, rules.max_devices_advanced))
    else:
        counter_slices = []
        for counter_set, devices in partitioned:
            _check_combined(counter_set, devices, rules)
            slices.append(SliceContent(tuple(devices), (counter_set,)))
    return (*counter_slices, *sorted(slices, key=lambda c: natural_key(c.devices[0]["name"])))


def _chunks(items: Sequence[Json], size: int) -> list[Sequence[Json]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _with_taints(devices: list[Json], gpu: Gpu, taints: Taints, rules: SliceRules) -> list[Json]:
    """Each device with its own taints and its GPU's (a fault of the GPU is a fault of all carved from it)."""
    if not taints:
        return devices
    of_gpu = list(taints.get(gpu_device_name(gpu.minor), ()))
    for device in devices:
        own = list(taints.get(device["name"], ())) if device["name"] != gpu_device_name(gpu.minor) else []
        merged = {t["key"]: t for t in [*of_gpu, *own]}  # one taint a key, as NVIDIA's driver keeps them
        if merged:
            device["taints"] = [dict(t) for t in merged.values()][: rules.max_taints]
    return devices


def _check_counter_set(counter_set: Json, limit: int, rules: SliceRules) -> None:
    if len(counter_set["counters"]) > limit:
        raise SliceLimitExceeded(
            f"counter set {counter_set['name']} has {len(counter_set['counters'])} counters; Kubernetes "
            f"{rules.label} allows {limit}"
        )


def _check_combined(counter_set: Json, devices: Sequence[Json], rules: SliceRules) -> None:
    """1.34: one GPU's counters and devices in one slice must fit that slice's limits."""
    _check_counter_set(counter_set, rules.max_counters_per_set, rules)
    consumed = sum(len(use["counters"]) for d in devices for use in d.get("consumesCounters", ()))
    if len(devices) > rules.max_devices_advanced or consumed > rules.max_counters_consumed:
        raise SliceLimitExceeded(
            f"{counter_set['name']}: {len(devices)} partitionable devices consuming {consumed} counters do not fit "
            f"one slice; Kubernetes {rules.label} allows {rules.max_devices_advanced} devices and "
            f"{rules.max_counters_consumed} consumed counters a slice"
        )


def resource_slices(
    content: Sequence[SliceContent],
    *,
    node_name: str,
    driver: str = DEFAULT_DRIVER,
    generation: int = 1,
    node_uid: str | None = None,
) -> list[Json]:
    """The API objects for one generation of the node's pool (pool name = node name)."""
    owner = (
        [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}]
        if node_uid
        else []
    )
    out = []
    for i, part in enumerate(content):
        metadata: Json = {"name": slice_name(node_name, driver, i)}
        if owner:
            metadata["ownerReferences"] = owner
        spec: Json = {
            "driver": driver,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": len(content)},
            "nodeName": node_name,
        }
        if part.devices or not part.shared_counters:  # 1.35+ refuses `devices`, even empty, beside counters
            spec["devices"] = [dict(d) for d in part.devices]
        if part.shared_counters:
            spec["sharedCounters"] = [dict(c) for c in part.shared_counters]
        out.append({"apiVersion": API_VERSION, "kind": "ResourceSlice", "metadata": metadata, "spec": spec})
    return out


def build_resource_slices(
    inventory: Inventory,
    node_name: str,
    driver: str = DEFAULT_DRIVER,
    *,
    partitionable: bool = False,
    node_uid: str | None = None,
    generation: int = 1,
    rules: SliceRules = LATEST,
    taints: Taints | None = None,
    share_mode: shares.ShareMode | None = None,
) -> list[Json]:
    """`pool_content` then `resource_slices`, for callers that do no bookkeeping of their own."""
    content = pool_content(inventory, partitionable=partitionable, rules=rules, taints=taints, share_mode=share_mode)
    return resource_slices(content, node_name=node_name, driver=driver, generation=generation, node_uid=node_uid)


def slice_name(node_name: str, driver: str, index: int) -> str:
    """`<node>-<driver with dashes>-<index>`, shortened with a hash to stay a valid DNS subdomain."""
    suffix = f"-{driver.replace('.', '-')}-{index}"
    if len(node_name) + len(suffix) <= _MAX_NAME:
        return node_name + suffix
    digest = hashlib.sha256(node_name.encode()).hexdigest()[:10]
    head = node_name[: _MAX_NAME - len(suffix) - len(digest) - 1].rstrip(".-")
    return f"{head}-{digest}{suffix}"


def natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts gpu-2 before gpu-10."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name) if part)


def semver(version: str) -> str | None:
    """A driver-reported version as semver 2.0.0: "9.0" -> "9.0.0", "535.104.05" -> "535.104.5".

    Semver forbids leading zeros, which NVIDIA driver versions have; None when it is not numeric.
    """
    parts = version.strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        return None
    return ".".join(str(int(p)) for p in [*parts, "0", "0"][:3])


# --- devices ------------------------------------------------------------------------------------------


def _string(value: str) -> Json:
    return {"string": value}


def _int(value: int) -> Json:
    return {"int": value}


def _quantities(values: Mapping[str, int]) -> Json:
    """Capacities or counters, as the API writes them: `{name: {"value": <quantity>}}`."""
    return {k: {"value": format_bytes(v)} for k, v in values.items()}


def _product_attributes(inventory: Inventory, gpu: Gpu) -> Json:
    """What a GPU and its MIG devices share: product, versions, PCI placement."""
    attrs: Json = {
        "productName": _string(gpu.product_name),
        "brand": _string(gpu.brand),
        "architecture": _string(gpu.architecture),
    }
    for key, raw in (
        ("cudaComputeCapability", gpu.cuda_compute_capability),
        ("driverVersion", inventory.driver_version),
        ("cudaDriverVersion", inventory.cuda_driver_version),
    ):
        if (version := semver(raw)) is not None:
            attrs[key] = {"version": version}
    attrs[_PCI + "pciBusID"] = _string(gpu.pci_bus_id)
    if gpu.pcie_root:
        attrs[_PCI + "pcieRoot"] = _string(gpu.pcie_root)
    if gpu.numa_node is not None and gpu.numa_node >= 0:
        attrs["numaNode"] = _int(gpu.numa_node)
    return attrs


def gpu_device(inventory: Inventory, gpu: Gpu, share_mode: shares.ShareMode | None = None) -> Json:
    """A whole GPU as a ResourceSlice device (also the local allocator's view of it); shareable by several
    claims at once with `share_mode`."""
    attrs: Json = {"type": _string("gpu"), "uuid": _string(gpu.uuid), **_product_attributes(inventory, gpu)}
    if gpu.nvlink_domain:
        attrs["nvlinkDomain"] = _string(gpu.nvlink_domain)
    attrs["index"] = _int(gpu.index)
    attrs["minor"] = _int(gpu.minor)
    device: Json = {"name": gpu_device_name(gpu.minor), "attributes": attrs}
    if share_mode is None:
        device["capacity"] = _quantities({"memory": gpu.memory_bytes})
    else:
        device["allowMultipleAllocations"] = True
        device["capacity"] = shares.capacity_json(shares.capacities(gpu.memory_bytes, share_mode))
    return device


@dataclass(frozen=True)
class _MigShape:
    """The sizes a MIG device (existing or possible) is published with."""

    memory_bytes: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int

    @classmethod
    def of(cls, m: MigProfile | MigDevice) -> _MigShape:
        return cls(
            m.memory_bytes, m.multiprocessors, m.copy_engines, m.decoders, m.encoders, m.jpeg_engines, m.ofa_engines
        )

    def capacity(self) -> Json:
        values = {
            "multiprocessors": self.multiprocessors,
            "copyEngines": self.copy_engines,
            "decoders": self.decoders,
            "encoders": self.encoders,
            "jpegEngines": self.jpeg_engines,
            "ofaEngines": self.ofa_engines,
            "memory": self.memory_bytes,
        }
        return _quantities(values)

    def counters(self) -> dict[str, int]:
        """Counter names are DNS labels, hence the dashes (as NVIDIA's driver names them)."""
        return {
            "memory": self.memory_bytes,
            "multiprocessors": self.multiprocessors,
            "copy-engines": self.copy_engines,
            "decoders": self.decoders,
            "encoders": self.encoders,
            "jpeg-engines": self.jpeg_engines,
            "ofa-engines": self.ofa_engines,
        }


def mig_device(
    inventory: Inventory,
    gpu: Gpu,
    mig: MigDevice | None = None,
    profile: MigProfile | None = None,
    placement: MigPlacement | None = None,
) -> Json:
    """An existing MIG device (`mig`), or a possible one (`profile` at `placement`)."""
    source: MigDevice | MigProfile
    if mig is not None:
        source, name, gi, start = mig, mig.profile, mig.gi_profile_id, mig.placement.start
    else:
        assert profile is not None and placement is not None
        source, name, gi, start = profile, profile.name, profile.gi_profile_id, placement.start
    attrs: Json = {"type": _string("mig"), "parentUUID": _string(gpu.uuid), "profile": _string(name)}
    if mig is not None:
        attrs["uuid"] = _string(mig.uuid)
    attrs.update(_product_attributes(inventory, gpu))
    if gpu.nvlink_domain:  # a MIG device reaches what its GPU reaches (gangs of MIG devices can match on it)
        attrs["nvlinkDomain"] = _string(gpu.nvlink_domain)
    return {
        "name": mig_device_name(gpu.minor, name, gi, start),
        "attributes": attrs,
        "capacity": _MigShape.of(source).capacity(),
    }


# --- partitionable GPUs -------------------------------------------------------------------------------


def counter_set_name(minor: int) -> str:
    return f"gpu-{minor}-counter-set"


def _instance_counter(profile: MigProfile) -> str:
    return f"profile-{profile.gi_profile_id}-instances"


def _limited(profile: MigProfile) -> bool:
    """The profile's instance limit is lower than its placements allow, so a counter must enforce it."""
    return profile.max_instances < len(profile.placements)


@functools.lru_cache(maxsize=64)
def _profile_budget(profiles: tuple[MigProfile, ...]) -> dict[str, int]:
    """A budget no valid layout exceeds: per kind, the best sum over non-overlapping placements.

    Memory slices make overlapping placements exclusive; instance counters enforce profile limits.
    """
    placements = [(_MigShape.of(p).counters(), pl) for p in profiles for pl in p.placements]
    slices = max(pl.start + pl.size for _, pl in placements)
    budget = {}
    for kind in placements[0][0]:
        best = [0] * (slices + 1)  # best[s]: the most of `kind` that placements within slices s.. hold
        for s in range(slices - 1, -1, -1):
            best[s] = max([best[s + 1]] + [c[kind] + best[pl.start + pl.size] for c, pl in placements if pl.start == s])
        budget[kind] = best[0]
    budget.update({f"memory-slice-{i}": 1 for i in range(slices)})
    budget.update({_instance_counter(p): p.max_instances for p in profiles if _limited(p)})
    return budget


def _gpu_counters(gpu: Gpu) -> dict[str, int]:
    budget = dict(_profile_budget(gpu.mig_profiles))
    budget["memory"] = max(budget["memory"], gpu.memory_bytes)
    return budget


def _consumes(gpu: Gpu, shape: _MigShape, placement: MigPlacement, profile: MigProfile | None) -> Json:
    counters = {k: v for k, v in shape.counters().items() if v}
    counters.update({f"memory-slice-{i}": 1 for i in placement.slices})
    if profile is not None and _limited(profile):
        counters[_instance_counter(profile)] = 1
    return {
        "counterSet": counter_set_name(gpu.minor),
        "counters": _quantities(counters),
    }


def _partitioned_gpu(
    inventory: Inventory, gpu: Gpu, migs: Sequence[MigDevice], *, whole: bool
) -> tuple[Json, list[Json]]:
    """One GPU as a counter set plus every device that can be carved from it.

    Existing MIG devices are kept; placements overlapping them or any other existing GPU instance are left
    out (creating them would fail); the whole GPU is offered only while no GPU instance exists, and then
    consumes every counter.
    """
    budget = _gpu_counters(gpu)
    occupied = [m.placement for m in migs] + [gi.placement for gi in gpu.gpu_instances]
    devices: list[Json] = []
    if whole and not occupied:
        device = gpu_device(inventory, gpu)
        device["consumesCounters"] = [
            {
                "counterSet": counter_set_name(gpu.minor),
                "counters": _quantities(budget),
            }
        ]
        devices.append(device)
    for mig in migs:
        device = mig_device(inventory, gpu, mig=mig)
        device["consumesCounters"] = [_consumes(gpu, _MigShape.of(mig), mig.placement, gpu.profile(mig.profile))]
        devices.append(device)
    for profile in gpu.mig_profiles:
        for placement in profile.placements:
            if any(placement.overlaps(taken) for taken in occupied):
                continue
            device = mig_device(inventory, gpu, profile=profile, placement=placement)
            device["consumesCounters"] = [_consumes(gpu, _MigShape.of(profile), placement, profile)]
            devices.append(device)
    devices.sort(key=lambda d: natural_key(d["name"]))
    counter_set = {
        "name": counter_set_name(gpu.minor),
        "counters": _quantities(budget),
    }
    return counter_set, devices
