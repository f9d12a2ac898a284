"""Consumable capacity (KEP-5075): one GPU shared by many claims, each taking a part of it. Pure.

A GPU published with `allowMultipleAllocations: true` can be allocated to several claims at once; each
allocation is a *share* with its own `shareID` and the capacity it consumed (`consumedCapacity`). How much a
request consumes is upstream's rule (k8s.io/dynamic-resource-allocation structured/internal/*/
consumable_capacity.go, `calculateConsumedCapacity`): no request takes the policy's `default` (the whole
capacity without a policy); a request below `validRange.min` is raised to it, then rounded up to the next
`min + n*step`; with `validValues` the smallest value at or above the request. A result above `max`, off the
step grid, or not among the valid values violates the policy and the device cannot be chosen; shares of a
device never consume more than its capacity.

The modes follow NVIDIA's `--consumable-shares` (cmd/gpu-kubelet-plugin/consumable_shares.go): `memory`
(a share asks for memory, 1Mi steps, the whole GPU by default), `unlimited` (memory 0 by default: shares are
limited by nothing but the memory they ask for) and `<N>` (at most N shares a GPU, each one of `shares`).
`memory` here also publishes a `shares` capacity of MAX_CLIENTS, each share taking one, because a GPU
serves at most that many MPS clients (the enforcement, see DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent.jsontypes import Json
from agent.quantity import QuantityError, format_bytes, parse

MIB = 1 << 20
MEMORY = "memory"
SHARES = "shares"
MAX_CLIENTS = 48  # MPS client contexts a Volta-or-later GPU serves at once (NVIDIA's MPS documentation)
MODES = ("disabled", "memory", "unlimited", "<N>")


class ShareError(ValueError):
    """A share setting, policy or request that cannot work; the message says which and why."""


@dataclass(frozen=True)
class ShareMode:
    """What `--consumable-shares` asked for: `memory`, `unlimited`, or at most `count` shares a GPU."""

    name: str  # memory | unlimited | count
    count: int = 0

    def __str__(self) -> str:
        return str(self.count) if self.name == "count" else self.name


def parse_mode(text: str | None) -> ShareMode | None:
    """`--consumable-shares`: None for off ("", "disabled"), else the mode; ShareError for anything else."""
    value = (text or "").strip().lower()
    if value in ("", "disabled", "false", "0"):
        return None
    if value in ("memory", "unlimited"):
        return ShareMode(value)
    if value.isdigit() and 0 < int(value) <= 10_000:
        return ShareMode("count", int(value))
    raise ShareError(
        f"--consumable-shares must be one of disabled, memory, unlimited or a share count 1..10000, not {text!r}"
    )


@dataclass(frozen=True)
class Policy:
    """A capacity's `requestPolicy` (values exact, in the capacity's unit)."""

    default: Fraction | None = None
    min: Fraction | None = None
    max: Fraction | None = None
    step: Fraction | None = None
    valid_values: tuple[Fraction, ...] = ()

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | None) -> Policy | None:
        if not raw:
            return None
        valid_range = raw.get("validRange") or {}
        return cls(
            default=_opt(raw.get("default")),
            min=_opt(valid_range.get("min")),
            max=_opt(valid_range.get("max")),
            step=_opt(valid_range.get("step")),
            valid_values=tuple(parse(str(v)).value for v in raw.get("validValues") or ()),
        )

    def to_json(self) -> Json:
        out: Json = {}
        if self.default is not None:
            out["default"] = _text(self.default)
        valid_range = {
            k: _text(v) for k, v in (("min", self.min), ("max", self.max), ("step", self.step)) if v is not None
        }
        if valid_range:
            out["validRange"] = valid_range
        if self.valid_values:
            out["validValues"] = [_text(v) for v in self.valid_values]
        return out


def _opt(raw: object) -> Fraction | None:
    return None if raw is None else parse(str(raw)).value


def _text(value: Fraction) -> str:
    """A value as a quantity: whole numbers canonically ("8Gi"), fractions in milli units ("500m") as far as
    they go (a quantity has at most nano precision; finer is rounded up, as Kubernetes rounds)."""
    if value.denominator == 1:
        return format_bytes(int(value))
    for scale, suffix in ((1000, "m"), (1000**2, "u"), (1000**3, "n")):
        if (value * scale).denominator == 1:
            return f"{int(value * scale)}{suffix}"
    return f"{-(-value.numerator * 1000**3 // value.denominator)}n"


@dataclass(frozen=True)
class Capacity:
    """One capacity of a shareable device: its total and how requests consume it."""

    value: Fraction
    policy: Policy | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Capacity:
        return cls(parse(str(raw.get("value", "0"))).value, Policy.from_json(raw.get("requestPolicy")))


def consumed(request: Fraction | None, capacity: Capacity) -> Fraction:
    """What one share consumes of `capacity` for `request` (None: the request does not name it), before the
    policy check: upstream's `calculateConsumedCapacity`."""
    policy = capacity.policy
    if request is None:
        return policy.default if policy is not None and policy.default is not None else capacity.value
    if policy is None:
        return request
    if policy.min is not None:
        if request < policy.min:
            return policy.min
        if policy.step is None:
            return request
        steps = -(-(request - policy.min) // policy.step)  # ceil
        return policy.min + steps * policy.step
    if policy.valid_values:
        return next((v for v in policy.valid_values if request <= v), request)
    return request


def violates(value: Fraction, policy: Policy | None) -> bool:
    """Whether a consumed amount breaks the policy (upstream's `violatesPolicy`): the device is then skipped."""
    if policy is None or (policy.default is not None and value == policy.default):
        return False
    if policy.min is not None or policy.max is not None or policy.step is not None:
        if policy.max is not None and value > policy.max:
            return True
        return policy.step is not None and policy.min is not None and (value - policy.min) % policy.step != 0
    if policy.valid_values:
        return value not in policy.valid_values
    return False


def share_of(requests: Mapping[str, Fraction], capacities: Mapping[str, Capacity]) -> dict[str, Fraction] | None:
    """Every capacity one share of a device consumes for `requests`, or None when the device cannot serve it
    (it lacks a requested capacity, or a value breaks its policy)."""
    if any(name not in capacities for name in requests):
        return None
    out = {}
    for name, capacity in capacities.items():
        value = consumed(requests.get(name), capacity)
        if value < 0 or violates(value, capacity.policy):
            return None
        out[name] = value
    return out


def producible(value: Fraction, capacity: Capacity) -> bool:
    """Whether some request could have made one share consume `value` of `capacity`: a value of `consumed`
    that `violates` passes. Everything `consumed` returns lies at or above the policy's min (a request below
    it is raised to it), so a value below it, or below zero, never came from the allocator."""
    policy = capacity.policy
    if value < 0:
        return False
    if policy is None or (policy.default is not None and value == policy.default):
        return True
    if policy.min is not None and value < policy.min:
        return False
    if policy.valid_values and policy.min is None:
        return value in policy.valid_values
    return not violates(value, policy)


def consumed_problem(raw: Mapping[str, Any], capacities: Mapping[str, Capacity], *, every: bool = True) -> str:
    """Why a share's allocated `consumedCapacity` is not what the device's request policies could have produced
    ("" when it is): a capacity missing (the allocator names every capacity of the device, `every`), one the
    device does not have, a value that is no quantity, negative, or off the policy. `every=False` checks only
    the capacities named (the device's policies are not known)."""
    values: dict[str, Fraction] = {}
    for name, text in raw.items():
        if name not in capacities:
            if every:
                return f"it consumes {name}, which the device does not have ({', '.join(sorted(capacities))})"
            continue
        try:
            values[name] = parse(str(text)).value
        except QuantityError as exc:
            return f"its {name} {str(text)[:40]!r} is not a quantity ({exc.reason})"
    for name, capacity in capacities.items():
        if name not in values:
            if every:
                return f"it names no {name}, which every share of the device consumes"
            continue
        if not producible(values[name], capacity):
            policy = capacity.policy.to_json() if capacity.policy is not None else {}
            return f"its {name}={_text(values[name])} is not a value the request policy {policy} allows"
    return ""


def fits(
    share: Mapping[str, Fraction], capacities: Mapping[str, Capacity], taken: Iterable[Mapping[str, Fraction]]
) -> bool:
    """Whether `share` fits beside the shares already `taken` of the device (no capacity over its value)."""
    totals = dict(share)
    for other in taken:
        for name, value in other.items():
            totals[name] = totals.get(name, Fraction(0)) + value
    return all(total <= capacities[name].value for name, total in totals.items() if name in capacities)


def requests_of(raw: Mapping[str, Any] | None) -> dict[str, Fraction]:
    """A device request's `capacity.requests` as exact values; ShareError for a value that is no quantity."""
    out = {}
    for name, value in ((raw or {}).get("requests") or {}).items():
        try:
            out[str(name)] = parse(str(value)).value
        except QuantityError as exc:
            raise ShareError(f"capacity request {name}: {exc}") from None
    return out


def consumed_of(raw: Mapping[str, Any] | None) -> dict[str, Fraction]:
    """An allocation result's `consumedCapacity` as exact values (unreadable entries count as nothing)."""
    out = {}
    for name, value in (raw or {}).items():
        try:
            out[str(name)] = parse(str(value)).value
        except QuantityError:
            continue
    return out


def to_quantities(values: Mapping[str, Fraction]) -> dict[str, str]:
    return {name: _text(v) for name, v in values.items()}


# --- publishing -------------------------------------------------------------------------------------------


def shareable_memory(memory_bytes: int) -> int:
    """The memory a shareable GPU publishes: rounded down to the 1Mi step, since validation wants the
    policy's max (the capacity) on the step grid (as NVIDIA's driver does)."""
    return memory_bytes // MIB * MIB


def capacities(memory_bytes: int, mode: ShareMode) -> dict[str, Capacity]:
    """The capacities a full GPU is published with in `mode`."""
    memory = Fraction(shareable_memory(memory_bytes))
    step = Fraction(MIB)
    if mode.name == "memory":
        out = {MEMORY: Capacity(memory, Policy(default=memory, min=step, max=memory, step=step))}
        shares = MAX_CLIENTS
    else:
        out = {MEMORY: Capacity(memory, Policy(default=Fraction(0), min=Fraction(0), max=memory, step=step))}
        shares = mode.count
    if shares:
        one = Fraction(1)
        out[SHARES] = Capacity(Fraction(shares), Policy(default=one, min=one, max=Fraction(shares), step=one))
    return out


def capacity_json(values: Mapping[str, Capacity]) -> Json:
    out: Json = {}
    for name, capacity in values.items():
        entry: Json = {"value": _text(capacity.value)}
        if capacity.policy is not None:
            entry["requestPolicy"] = capacity.policy.to_json()
        out[name] = entry
    return out


# --- accounting -------------------------------------------------------------------------------------------


def gpu_fraction(share_memory: Fraction | int, device_memory: Fraction | int) -> float:
    """How much of a GPU a share is worth in queue accounting: its memory over the device's (1 at most; a
    share that names no memory, as under `<N>` with no memory request, is worth nothing by memory and the
    caller counts its `shares` instead)."""
    if device_memory <= 0:
        return 1.0
    return min(1.0, float(Fraction(share_memory) / Fraction(device_memory)))


def describe(values: Mapping[str, Fraction]) -> str:
    """`memory=8Gi, shares=1`, for messages."""
    return ", ".join(f"{k}={_text(v)}" for k, v in sorted(values.items()))
