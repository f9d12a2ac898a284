"""The local allocator: does a claim fit on this node, which devices does it take, how good is the fit.

Pure: the inventory, what is taken (NodeUsage) and the claim come in; a Fit or NoFit goes out.
Policies: binpack (fill what is used, keep GPUs and NVLink domains whole), spread (the emptiest first),
fgd (the GPU choice that least increases fragmentation for an expected request mix). Whatever the policy,
several GPUs come from one NVLink domain where one can hold them, and a MIG request takes an existing free
MIG device before creating one, and then the placement that keeps the most future placements possible.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

from agent.allocation.catalog import (
    DRIVER,
    Candidate,
    NodeUsage,
    candidates,
    occupied_layout,
)
from agent.allocation.fragmentation import (
    MILLI,
    NodeShape,
    RequestKind,
    RequestMix,
    after_placing,
    fragmentation,
    packed_fgd_score,
)
from agent.allocation.selectors import SelectorEngine
from agent.devices.geometry import PlacedProfile, count_free_placements, is_valid_layout
from agent.devices.model import Inventory
from agent.devices.names import gpu_device_name
from agent.names import GPU_CLASS, MIG_CLASS

# The request mix fgd assumes when the caller knows none: whole GPUs and common fractions.
DEFAULT_MIX = RequestMix(
    (
        RequestKind(0, 1, 1000, (), 4),
        RequestKind(0, 1, 500, (), 2),
        RequestKind(0, 1, 250, (), 2),
        RequestKind(0, 2, 1000, (), 1),
        RequestKind(0, 4, 1000, (), 1),
        RequestKind(0, 8, 1000, (), 1),
    )
)


class Policy(enum.Enum):
    """How a claim's devices are chosen on a node. FGD (the default) is the replay's `ours`: the choice that
    grows fragmentation least for the expected request mix, ties to a node in use; BINPACK takes the tightest
    devices, SPREAD the roomiest."""

    BINPACK = "binpack"
    SPREAD = "spread"
    FGD = "fgd"


class NoFit(Exception):
    """The claim cannot be satisfied on this node; the message says which request and why."""


@dataclass(frozen=True)
class DeviceRequest:
    """One request of a claim: `count` devices of a class matching every selector, or a GPU fraction."""

    name: str
    device_class: str = GPU_CLASS
    selectors: tuple[str, ...] = ()
    count: int = 1
    gpu_milli: int | None = None  # a share of one GPU (1..999); the GPU must allow sharing

    def __post_init__(self) -> None:
        if self.device_class not in (GPU_CLASS, MIG_CLASS):
            raise ValueError(f"request {self.name!r}: unknown device class {self.device_class!r}")
        if self.count < 1:
            raise ValueError(f"request {self.name!r}: count must be at least 1, got {self.count}")
        if self.gpu_milli is not None and (
            self.device_class != GPU_CLASS or self.count != 1 or not 0 < self.gpu_milli < MILLI
        ):
            raise ValueError(f"request {self.name!r}: a GPU fraction is 1..999 milli of one {GPU_CLASS} GPU")


@dataclass(frozen=True)
class Claim:
    """What one pod (gang member) asks for; `match_attributes` must be equal across all its devices."""

    requests: tuple[DeviceRequest, ...]
    match_attributes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Fit:
    devices: dict[str, tuple[str, ...]]  # request name -> device names
    shared_milli: dict[str, int] = field(default_factory=dict)  # device -> fraction taken
    score: float = 0.0  # higher is better, comparable across nodes under one policy

    @property
    def all_devices(self) -> frozenset[str]:
        return frozenset(d for names in self.devices.values() for d in names)


def _attribute(c: Candidate, qualified: str) -> object:
    domain, _, name = qualified.rpartition("/")
    return c.env["attributes"].get(domain or DRIVER, {}).get(name)


def _shape(inv: Inventory, usage: NodeUsage) -> tuple[NodeShape, list[str]]:
    """The node as fragmentation sees it: idle milli of each whole (non-MIG) GPU."""
    names, free = [], []
    for g in sorted(inv.gpus, key=lambda g: g.minor):
        if g.mig_enabled:
            continue
        name = gpu_device_name(g.minor)
        names.append(name)
        free.append(0 if name in usage.taken else MILLI - usage.shared_milli.get(name, 0))
    return NodeShape("", 1 << 60, tuple(free)), names


class Allocator:
    def __init__(self, selectors: SelectorEngine, policy: Policy = Policy.FGD, mix: RequestMix = DEFAULT_MIX) -> None:
        self.selectors = selectors
        self.policy = policy
        self.mix = mix

    def allocate(self, inv: Inventory, usage: NodeUsage, claim: Claim) -> Fit:
        """The devices this claim takes on this node, or NoFit saying why not."""
        if not claim.requests:
            raise NoFit("the claim has no requests")
        pool = candidates(inv, usage)
        eligible = {r.name: [c for c in pool if self._eligible(c, r)] for r in claim.requests}
        for r in claim.requests:
            if not eligible[r.name]:
                raise NoFit(f"request {r.name!r}: no free {r.device_class} device matches")
        groups: list[dict[str, list[Candidate]]] = [eligible]
        for attr in claim.match_attributes:
            # Group on the value's canonical JSON: ints, strings and versions alike, and a stable order.
            groups = [
                {k: [c for c in cs if _value_key(_attribute(c, attr)) == v] for k, cs in g.items()}
                for g in groups
                for v in sorted({_value_key(_attribute(c, attr)) for cs in g.values() for c in cs} - {_NONE})
            ]
        fits = []
        for g in groups:
            try:
                fits.append(self._pick(inv, usage, claim, g))
            except NoFit:
                continue
        if not fits:
            reason = " with equal " + ", ".join(claim.match_attributes) if claim.match_attributes else ""
            raise NoFit(f"not enough free devices for every request{reason}")
        return max(fits, key=lambda f: f.score)

    def _eligible(self, c: Candidate, r: DeviceRequest) -> bool:
        if c.kind != ("mig" if r.device_class == MIG_CLASS else "gpu"):
            return False
        if r.gpu_milli is not None:
            if (not c.gpu.time_slicing_supported and not c.gpu.mps_supported) or c.free_milli < r.gpu_milli:
                return False
        elif c.kind == "gpu" and c.free_milli < MILLI:
            return False
        return all(self.selectors.matches(s, c.env) for s in r.selectors)

    def _pick(self, inv: Inventory, usage: NodeUsage, claim: Claim, group: dict[str, list[Candidate]]) -> Fit:
        chosen: dict[str, tuple[str, ...]] = {}
        shared: dict[str, int] = {}
        used: set[str] = set()
        planned: dict[int, list[PlacedProfile]] = {}  # parent minor -> MIG placements chosen here
        for r in claim.requests:
            pool = [c for c in group[r.name] if c.name not in used]
            if r.gpu_milli is not None:
                picked = [self._pick_fraction(inv, usage, pool, r.gpu_milli)]
                shared[picked[0].name] = r.gpu_milli
            elif r.device_class == MIG_CLASS:
                picked = self._pick_mig(inv, usage, pool, r.count, planned)
            else:
                picked = self._pick_gpus(pool, r.count)
            used.update(c.name for c in picked)
            chosen[r.name] = tuple(c.name for c in picked)
        return Fit(chosen, shared, self._score(inv, usage, used, shared))

    def _pick_gpus(self, pool: list[Candidate], count: int) -> list[Candidate]:
        if len(pool) < count:
            raise NoFit(f"{count} GPUs wanted, {len(pool)} free")
        by_domain: dict[str, list[Candidate]] = {}
        for c in pool:
            by_domain.setdefault(c.nvlink_domain, []).append(c)
        spread = self.policy is Policy.SPREAD
        # one domain that holds them all: the tightest (binpack, fgd) or the roomiest (spread)
        whole = [d for d in by_domain.values() if len(d) >= count]
        if whole:
            best = (max if spread else min)(whole, key=lambda d: (len(d), -d[0].gpu.minor))
            return sorted(best, key=lambda c: c.gpu.minor)[:count]
        ordered = sorted(by_domain.values(), key=lambda d: (-len(d), d[0].gpu.minor))
        return [c for d in ordered for c in sorted(d, key=lambda c: c.gpu.minor)][:count]

    def _pick_fraction(self, inv: Inventory, usage: NodeUsage, pool: list[Candidate], milli: int) -> Candidate:
        if self.policy is Policy.SPREAD:
            return max(pool, key=lambda c: (c.free_milli, -c.gpu.minor))
        if self.policy is Policy.FGD:
            shape, names = _shape(inv, usage)
            before = fragmentation(shape, self.mix)

            def growth(c: Candidate) -> tuple[int, int, int]:
                after = fragmentation(after_placing(shape, 0, milli, [names.index(c.name)]), self.mix)
                return (after - before, c.free_milli, c.gpu.minor)

            return min(pool, key=growth)
        return min(pool, key=lambda c: (c.free_milli, c.gpu.minor))  # tightest: keep whole GPUs whole

    def _pick_mig(
        self,
        inv: Inventory,
        usage: NodeUsage,
        pool: list[Candidate],
        count: int,
        planned: dict[int, list[PlacedProfile]],
    ) -> list[Candidate]:
        picked: list[Candidate] = []
        occupied: dict[int, list[PlacedProfile]] = {}  # parent minor -> its layout before this claim
        for _ in range(count):
            existing = [c for c in pool if c.exists and c not in picked]
            if existing:
                picked.append(min(existing, key=lambda c: c.name))
                continue
            options = []
            for c in pool:
                if c.exists or c in picked or c.mig_profile is None or c.placement is None:
                    continue
                if c.gpu.minor not in occupied:
                    occupied[c.gpu.minor] = occupied_layout(c.gpu, inv, usage)
                layout = [*occupied[c.gpu.minor], *planned.get(c.gpu.minor, [])]
                placed = PlacedProfile.of(c.mig_profile, c.placement)
                if not is_valid_layout([*layout, placed], c.gpu.mig_profiles):
                    continue
                room = count_free_placements(c.gpu.mig_profiles, [*layout, placed])
                options.append((-room, c.gpu.minor, c.placement.start, c, placed))
            if not options:
                raise NoFit(f"{count} MIG devices wanted, fewer can be placed")
            *_, best, placed = min(options, key=lambda o: o[:3])
            planned.setdefault(best.gpu.minor, []).append(placed)
            picked.append(best)
        return picked

    def _score(self, inv: Inventory, usage: NodeUsage, taken: set[str], shared: dict[str, int]) -> float:
        shape, names = _shape(inv, usage)
        total = len(shape.gpu_free) * MILLI or 1
        after = list(shape.gpu_free)
        for i, name in enumerate(names):
            if name in shared:
                after[i] -= shared[name]
            elif name in taken:
                after[i] = 0
        if self.policy is Policy.SPREAD:
            return sum(after) / total
        if self.policy is Policy.FGD:
            drop = fragmentation(shape, self.mix) - fragmentation(NodeShape("", shape.cpu_free, tuple(after)), self.mix)
            in_use = sum(shape.gpu_free) < total or bool(usage.taken - usage.unhealthy)
            return packed_fgd_score(drop, self.mix.total_weight, in_use, shares_gpu=bool(shared) and not taken)
        return 1 - sum(after) / total


def _value_key(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)


_NONE = _value_key(None)  # devices without the attribute match no group
