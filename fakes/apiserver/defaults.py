"""Defaults kube-apiserver fills in on every write of resource.k8s.io/v1 objects, before validation.

From pkg/apis/resource/v1/defaults.go (1.37): a request's `allocationMode` defaults to ExactCount and, in
that mode, `count` to 1 (for `exactly` and for each `firstAvailable` subrequest); a device taint's
`timeAdded` to the time of the write, in whole seconds. And from pkg/apis/admissionregistration/v1/defaults.go:
an admission policy's matchConstraints get matchPolicy Equivalent, empty namespace and object selectors, and each
resource rule scope "*" (so a manifest that leaves them out differs from the stored policy, as on a real server).
"""

from __future__ import annotations

import datetime
from typing import Any


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _request(request: Any) -> None:
    if not isinstance(request, dict):
        return  # left for validation to reject
    request.setdefault("allocationMode", "ExactCount")
    if request["allocationMode"] == "ExactCount" and not request.get("count"):
        request["count"] = 1


def _claim_spec(spec: Any) -> None:
    devices = spec.get("devices") if isinstance(spec, dict) else None
    requests = devices.get("requests") if isinstance(devices, dict) else None
    for request in requests or ():
        if not isinstance(request, dict):
            continue
        if request.get("exactly") is not None:
            _request(request["exactly"])
        for sub in request.get("firstAvailable") or ():
            _request(sub)


def _taint(taint: Any) -> None:
    if isinstance(taint, dict) and not taint.get("timeAdded"):
        taint["timeAdded"] = _now()


def apply(kind: str, obj: dict[str, Any]) -> None:
    """Fill in the defaults of `obj` (a resource.k8s.io/v1 object of `kind`) in place."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    if kind == "ResourceClaim":
        _claim_spec(spec)
    elif kind == "ResourceClaimTemplate":
        _claim_spec(spec.get("spec"))
    elif kind == "ResourceSlice":
        for device in spec.get("devices") or ():
            for taint in (device.get("taints") or ()) if isinstance(device, dict) else ():
                _taint(taint)
    elif kind == "DeviceTaintRule":
        _taint(spec.get("taint"))


POLICY_KINDS = ("ValidatingAdmissionPolicy", "MutatingAdmissionPolicy")


def admission_policy(obj: dict[str, Any]) -> None:
    """Fill in the defaults of a Validating- or MutatingAdmissionPolicy in place."""
    spec = obj.get("spec")
    constraints = spec.get("matchConstraints") if isinstance(spec, dict) else None
    if not isinstance(constraints, dict):
        return
    constraints.setdefault("matchPolicy", "Equivalent")
    constraints.setdefault("namespaceSelector", {})
    constraints.setdefault("objectSelector", {})
    for rule in constraints.get("resourceRules") or ():
        if isinstance(rule, dict):
            rule.setdefault("scope", "*")
