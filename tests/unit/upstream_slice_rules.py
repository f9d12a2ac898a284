"""Upstream's ResourceSlice rules per Kubernetes version, written out independently of agent.slices.versions so
tests can check what the agent builds against them (and catch a wrong number in the agent's table).

Sources: k8s.io/api resource/v1/types.go constants at tags v0.34.0, v0.35.0, v0.36.0, v0.37.0-beta.0, and
kubernetes/kubernetes pkg/apis/resource/validation/validation.go `validateResourceSliceSpec` / `validateDevice`
(1.35+: "only one of `sharedCounters` or `devices` is allowed"; maxDevices drops to 64 when haveDeviceTaints or
haveConsumesCounters). The JSON schemas (kubernetes-validate) carry none of these limits.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate

VERSIONS = ("1.34", "1.35", "1.36", "1.37")


def _minor(version: str) -> int:
    return int(version.split(".")[1])


def slice_errors(obj: dict[str, Any], version: str) -> list[str]:
    """What kube-apiserver `version` would refuse in this ResourceSlice (schema included)."""
    kubernetes_validate.validate(obj, version, strict=True)
    spec = obj["spec"]
    devices = spec.get("devices") or []
    sets = spec.get("sharedCounters") or []
    errors = []
    if _minor(version) >= 35:
        if "devices" in spec and "sharedCounters" in spec:
            errors.append("only one of `sharedCounters` or `devices` is allowed")
        advanced = any(d.get("taints") or d.get("consumesCounters") for d in devices)
        if len(devices) > (64 if advanced else 128):
            errors.append(f"{len(devices)} devices (advanced: {advanced})")
        if len(sets) > 8:
            errors.append(f"{len(sets)} counter sets")
        errors += [f"counter set {s['name']}: {len(s['counters'])} counters" for s in sets if len(s["counters"]) > 32]
        for d in devices:
            if len(d.get("consumesCounters") or []) > 2:
                errors.append(f"{d['name']}: more than 2 counter consumptions")
            if len(d.get("taints") or []) > 16:
                errors.append(f"{d['name']}: more than 16 taints")
    else:
        if len(devices) > 128:
            errors.append(f"{len(devices)} devices")
        if sum(len(s["counters"]) for s in sets) > 32:
            errors.append("more than 32 shared counters over all sets")
        consumed = [len(u["counters"]) for d in devices for u in d.get("consumesCounters") or []]
        if sum(consumed) > 1024 or any(n > 32 for n in consumed):
            errors.append("device counter consumption over 1024 a slice or 32 a device")
        errors += [f"{d['name']}: more than 4 taints" for d in devices if len(d.get("taints") or []) > 4]
    return errors


def pool_errors(slices: list[dict[str, Any]], version: str) -> list[str]:
    """Every slice valid, and the pool consistent: one generation, the right slice count, unique device and
    counter set names, every consumed counter defined (on 1.34 in the device's own slice)."""
    errors = [e for s in slices for e in slice_errors(s, version)]
    pools = {
        (s["spec"]["pool"]["name"], s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
        for s in slices
    }
    if len(pools) != 1 or next(iter(pools))[2] != len(slices):
        errors.append(f"pool {pools} does not match its {len(slices)} slices")
    names = [d["name"] for s in slices for d in s["spec"].get("devices") or []]
    if len(names) != len(set(names)):
        errors.append("duplicate device names")
    sets = {c["name"]: c["counters"] for s in slices for c in s["spec"].get("sharedCounters") or []}
    if len(sets) != sum(len(s["spec"].get("sharedCounters") or []) for s in slices):
        errors.append("duplicate counter set names")
    for s in slices:
        visible = (
            sets if _minor(version) >= 35 else {c["name"]: c["counters"] for c in s["spec"].get("sharedCounters") or []}
        )
        for d in s["spec"].get("devices") or []:
            for use in d.get("consumesCounters") or []:
                defined = visible.get(use["counterSet"])
                if defined is None or not use["counters"].keys() <= defined.keys():
                    errors.append(f"{d['name']} consumes counters {use['counterSet']} does not define")
    return errors
