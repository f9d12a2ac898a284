"""The fence that makes the arbiter the only allocator of its driver's devices: a DeviceTaintRule.

kube-scheduler's DRA allocator (and every allocator built on k8s.io/dynamic-resource-allocation) allocates a
device only to a request that tolerates each of its NoSchedule taints, DeviceTaintRules included. The rule
below taints every device of the driver; no claim users write tolerates it, so only the arbiter, which writes
allocations itself after its node agents reserved the devices, allocates them. NoSchedule leaves allocated
claims alone: kube-scheduler binds pods whose claims are allocated already, and nothing is evicted.

Pure: the rule's body, and whether a rule as read still fences. The controller creates or restores it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent.names import FENCE_RULE, FENCE_TAINT

EFFECT = "NoSchedule"


def fence_rule(driver: str) -> dict[str, Any]:
    """The DeviceTaintRule (resource.k8s.io/v1, 1.37) that keeps every other allocator off `driver`'s devices."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceTaintRule",
        "metadata": {"name": FENCE_RULE, "labels": {"app.kubernetes.io/name": "gpu-dra-agent"}},
        "spec": {"deviceSelector": {"driver": driver}, "taint": {"key": FENCE_TAINT, "effect": EFFECT}},
    }


def fences(rule: Mapping[str, Any] | None, driver: str) -> bool:
    """Whether `rule` (the object named FENCE_RULE, as read) still keeps others off every device of `driver`:
    selects the whole driver (no pool or device narrowing) with our NoSchedule taint (NoExecute would evict every
    pod using the devices: restored like any other change)."""
    if rule is None:
        return False
    spec = rule.get("spec") or {}
    selector = spec.get("deviceSelector") or {}
    taint = spec.get("taint") or {}
    whole_driver = selector.get("driver") == driver and not selector.get("pool") and not selector.get("device")
    return whole_driver and taint.get("key") == FENCE_TAINT and taint.get("effect") == EFFECT


def default_queue(name: str) -> dict[str, Any]:
    """The Queue a pod that names none waits in, as the arbiter creates it when missing: top level, no GPU quota,
    so it gets what the other queues leave over. Created by the arbiter, not shipped in the overlay: one
    `kubectl apply` cannot create a CRD and an object of it (the kind is not served yet when kubectl maps it)."""
    unlimited = {"quota": -1, "limit": -1, "overQuotaWeight": 1}
    return {
        "apiVersion": "scheduling.gpu-dra-agent.io/v1alpha1",
        "kind": "Queue",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "gpu-dra-agent"}},
        "spec": {
            "resources": {
                "gpu": {"quota": 0, "limit": -1, "overQuotaWeight": 1},
                "cpu": dict(unlimited),
                "memory": dict(unlimited),
            }
        },
    }
