"""resource.k8s.io/v1 validation rules the schemas do not carry, per minor release.

Where they live upstream (k8s.io/kubernetes): pkg/apis/resource/validation/validation.go
(validateResourceSliceSpec, validateDevice, validateCounterSet, validateDeviceCounterConsumption,
validateDeviceTaint) with the limits of pkg/apis/resource/types.go. 1.34 caps counters over all sets of a slice
(ResourceSliceMaxSharedCounters = 32) and counter consumptions per slice (1024); from 1.35 counter sets sit in
slices of their own ("only one of `sharedCounters` or `devices` is allowed"), at most 8 sets of 32 counters, at
most 2 consumptions per device, 64 devices in a slice whose devices use taints or consume counters, 16 taints a
device, and the taint effect None is valid.
"""

from __future__ import annotations

import itertools
import re
from fractions import Fraction
from typing import Any

from agent import quantity

from . import selector_cel

Causes = list[tuple[str, str]]

MAX_DEVICES_PER_SLICE = 128
MAX_DEVICES_WITH_TAINTS_OR_COUNTERS = 64  # 1.35+
MAX_COUNTER_SETS = 8  # 1.35+
MAX_COUNTERS_PER_SET = 32  # 1.35+
MAX_CONSUMPTIONS_PER_DEVICE = 2  # 1.35+
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_ATTRIBUTE_VALUE_LENGTH = 64
MAX_SHARED_COUNTERS = 32
MAX_COUNTERS_PER_DEVICE = 32
MAX_COUNTER_CONSUMPTIONS_PER_SLICE = 1024
MAX_TAINTS_134 = 4
MAX_TAINTS = 16  # 1.35+
MAX_REQUESTS = 32
MAX_SUBREQUESTS = 8
MAX_SELECTORS = 32
MAX_CONSTRAINTS = 32
MAX_CONFIGS = 32
MAX_CEL_LENGTH = 10 * 1024
MAX_OPAQUE_PARAMETERS = 10 * 1024
MAX_RESERVED_FOR = 256
MAX_ALLOCATION_RESULTS = 32
MAX_VALID_VALUES = 10  # CapacityRequestPolicyDiscreteMaxOptions

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")  # RFC 4122, lowercase
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# semver 2.0.0, the rule agent.allocation.cel also has; not imported from there, because that would load the
# CEL bindings (and their CLI) into every fake API server.
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?$"
)
_NODE_FIELDS = ("nodeName", "nodeSelector", "allNodes")  # where a slice's (or a device's) devices are usable


def dns_label(value: Any) -> str | None:
    """None when valid, else why not."""
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > 63:
        return f"must be no more than 63 characters (is {len(value)})"
    if not _DNS_LABEL.match(value):
        return (
            "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
            "and must start and end with an alphanumeric character"
        )
    return None


def dns_subdomain(value: Any, limit: int = 253) -> str | None:
    if not isinstance(value, str) or not value:
        return "must be a non-empty string"
    if len(value) > limit:
        return f"must be no more than {limit} characters (is {len(value)})"
    if not _DNS_SUBDOMAIN.match(value):
        return (
            "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
            "and must start and end with an alphanumeric character"
        )
    return None


def qualified_name(value: str) -> str | None:
    """A C identifier of at most 32 characters, optionally prefixed with `<DNS subdomain>/`."""
    domain, _, ident = value.rpartition("/")
    if "/" in value:
        why = dns_subdomain(domain, 63)
        if why:
            return f"domain {domain!r}: {why}"
    if len(ident) > 32:
        return f"name must be no more than 32 characters (is {len(ident)})"
    if not _C_IDENTIFIER.match(ident):
        return "name must be a C identifier (letters, digits, '_', not starting with a digit)"
    return None


def _node_selection(where: str, holder: dict[str, Any], fields: tuple[str, ...]) -> Causes:
    given = [f for f in fields if holder.get(f) not in (None, False, "")]
    out: Causes = []
    if len(given) != 1:
        out.append((where, f"exactly one of {', '.join(fields)} is required (given: {', '.join(given) or 'none'})"))
    if "allNodes" in holder and holder["allNodes"] is False:
        out.append((f"{where}.allNodes", "must be true when set"))
    if holder.get("nodeName"):
        why = dns_subdomain(holder["nodeName"])
        if why:
            out.append((f"{where}.nodeName", why))
    terms = (holder.get("nodeSelector") or {}).get("nodeSelectorTerms")
    if holder.get("nodeSelector") is not None and len(terms or []) != 1:
        out.append((f"{where}.nodeSelector.nodeSelectorTerms", "must have exactly one node selector term"))
    return out


def _attribute(where: str, value: Any) -> Causes:
    if not isinstance(value, dict):
        return [(where, "must be an object")]
    set_fields = [k for k in ("int", "bool", "string", "version") if value.get(k) is not None]
    if len(set_fields) != 1:
        return [(where, f"exactly one value must be specified (given: {', '.join(set_fields) or 'none'})")]
    text = value.get("string", value.get("version"))
    if isinstance(text, str) and len(text) > MAX_ATTRIBUTE_VALUE_LENGTH:
        return [(where, f"must be no more than {MAX_ATTRIBUTE_VALUE_LENGTH} characters (is {len(text)})")]
    if "version" in set_fields and not _SEMVER.match(str(value["version"])):
        return [(f"{where}.version", f"{value['version']!r} must be a semantic version (semver 2.0.0)")]
    return []


def _quantity(value: Any) -> Fraction | None:
    try:
        return quantity.parse(str(value)).value
    except quantity.QuantityError:
        return None


def _capacity(where: str, capacity: Any, shareable: bool) -> Causes:
    """A device capacity's requestPolicy (validateMultiAllocatableDeviceCapacity and validateRequestPolicyRange
    in pkg/apis/resource/validation): only on a device with allowMultipleAllocations; one of validValues and
    validRange, each with a default inside it; min <= max <= value; min + step <= value; default and max on
    the step grid from min; at most 10 valid values, ascending, none above the value."""
    policy = capacity.get("requestPolicy") if isinstance(capacity, dict) else None
    if policy is None:
        return []
    at = f"{where}.requestPolicy"
    if not shareable:
        return [(at, "Forbidden: allowMultipleAllocations must be true")]
    value = _quantity(capacity.get("value"))
    default = _quantity(policy["default"]) if policy.get("default") is not None else None
    valid_values = policy.get("validValues") or []
    valid_range = policy.get("validRange")
    if value is None:
        return []
    if valid_values and valid_range is not None:
        return [
            (at, 'exactly one policy can be specified, cannot specify "validValues" and "validRange" at the same time')
        ]
    out: Causes = []
    if valid_values:
        if default is None:
            return [(f"{at}.default", "Required value: required when validValues is defined")]
        values = [_quantity(v) for v in valid_values]
        if len(values) > MAX_VALID_VALUES:
            out.append((f"{at}.validValues", f"must have at most {MAX_VALID_VALUES} items"))
        for i, (a, b) in enumerate(itertools.pairwise(values)):
            if a is not None and b is not None and a > b:
                out.append((f"{at}.validValues[{i + 1}]", "values must be sorted in ascending order"))
        out += [
            (f"{at}.validValues[{i}]", f"option is larger than capacity value: {capacity.get('value')}")
            for i, v in enumerate(values)
            if v is not None and v > value
        ]
        if default not in values:
            out.append((f"{at}.validValues", "default value is not valid according to the requestPolicy"))
        return out
    if valid_range is None:
        return out
    if default is None:
        return [(f"{at}.default", "Required value: required when validRange is defined")]
    low, high, step = (
        _quantity(valid_range[k]) if valid_range.get(k) is not None else None for k in ("min", "max", "step")
    )
    if low is None:
        return [(f"{at}.validRange.min", "Required value: required when validRange is defined")]
    if low > value:
        out.append((f"{at}.validRange.min", f"min is larger than capacity value: {capacity.get('value')}"))
    if default < low:
        out.append((f"{at}.validRange.default", f"default is less than min: {valid_range['min']}"))
    if high is not None:
        if low > high:
            out.append((f"{at}.validRange.max", f"min is larger than max: {valid_range['max']}"))
        if high > value:
            out.append((f"{at}.validRange.max", f"max is larger than capacity value: {capacity.get('value')}"))
        if default > high:
            out.append((f"{at}.validRange.default", f"default is more than max: {valid_range['max']}"))
    if step is not None:
        if step <= 0:
            return [*out, (f"{at}.validRange.step", "must be greater than zero")]
        if low + step > value:
            out.append(
                (
                    f"{at}.validRange.step",
                    f"one step {low + step} is larger than capacity value: {capacity.get('value')}",
                )
            )
        for bound in (default, high):
            if bound is not None and (int(bound) - int(low)) % int(step):
                out.append(
                    (
                        f"{at}.validRange.step",
                        f"value is not a multiple of a given step ({valid_range['step']}) from ({valid_range['min']})",
                    )
                )
    return out


def _counters(where: str, counters: Any) -> Causes:
    if not isinstance(counters, dict) or not counters:
        return [(where, "at least one counter is required")]
    return [(f"{where}[{name}]", why) for name in counters if (why := dns_label(name))]


def _device(
    where: str, device: dict[str, Any], per_device_nodes: bool, counter_sets: dict[str, set[str]], minor: int
) -> Causes:
    out: Causes = []
    why = dns_label(device.get("name"))
    if why:
        out.append((f"{where}.name", why))
    attributes = device.get("attributes") or {}
    capacity = device.get("capacity") or {}
    if len(attributes) + len(capacity) > MAX_ATTRIBUTES_AND_CAPACITIES:
        out.append(
            (
                where,
                f"the combined number of attributes and capacities must not exceed "
                f"{MAX_ATTRIBUTES_AND_CAPACITIES} (is {len(attributes) + len(capacity)})",
            )
        )
    for name, value in attributes.items():
        if why := qualified_name(name):
            out.append((f"{where}.attributes[{name}]", why))
        out += _attribute(f"{where}.attributes[{name}]", value)
    for name in capacity:
        if why := qualified_name(name):
            out.append((f"{where}.capacity[{name}]", why))
        if name in attributes:
            out.append((f"{where}.capacity[{name}]", "attribute and capacity names must be unique"))
        out += _capacity(f"{where}.capacity[{name}]", capacity[name], device.get("allowMultipleAllocations") is True)
    consumed = device.get("consumesCounters") or []
    seen_sets: set[str] = set()
    total = 0
    for i, use in enumerate(consumed):
        set_name = use.get("counterSet")
        at = f"{where}.consumesCounters[{i}]"
        if set_name in seen_sets:
            out.append((f"{at}.counterSet", f"duplicate counter set {set_name!r}"))
        seen_sets.add(set_name)
        if minor >= 35:
            pass  # the counter set lives in another slice of the pool; a single write cannot check it
        elif set_name not in counter_sets:
            out.append((f"{at}.counterSet", f"must reference a counter set in spec.sharedCounters (not {set_name!r})"))
        else:
            unknown = set(use.get("counters") or {}) - counter_sets[set_name]
            out += [(f"{at}.counters[{c}]", f"counter not in counter set {set_name!r}") for c in sorted(unknown)]
        out += _counters(f"{at}.counters", use.get("counters"))
        total += len(use.get("counters") or {})
        if minor >= 35 and len(use.get("counters") or {}) > MAX_COUNTERS_PER_SET:
            out.append((f"{at}.counters", f"must have at most {MAX_COUNTERS_PER_SET} counters"))
    if minor >= 35 and len(consumed) > MAX_CONSUMPTIONS_PER_DEVICE:
        out.append(
            (
                f"{where}.consumesCounters",
                f"must have at most {MAX_CONSUMPTIONS_PER_DEVICE} entries (is {len(consumed)})",
            )
        )
    if minor < 35 and total > MAX_COUNTERS_PER_DEVICE:
        out.append(
            (f"{where}.consumesCounters", f"must consume at most {MAX_COUNTERS_PER_DEVICE} counters (is {total})")
        )
    if per_device_nodes:
        out += _node_selection(where, device, _NODE_FIELDS)
    else:
        out += [
            (f"{where}.{f}", "may only be set when perDeviceNodeSelection is true")
            for f in _NODE_FIELDS
            if device.get(f) not in (None, False, "")
        ]
    taints = device.get("taints") or []
    max_taints = MAX_TAINTS if minor >= 35 else MAX_TAINTS_134
    effects = ("None", "NoSchedule", "NoExecute") if minor >= 35 else ("NoSchedule", "NoExecute")
    if len(taints) > max_taints:
        out.append((f"{where}.taints", f"must have at most {max_taints} taints (is {len(taints)})"))
    for i, taint in enumerate(taints):
        if taint.get("effect") not in effects:
            out.append((f"{where}.taints[{i}].effect", f"must be one of {', '.join(effects)}"))
    return out


def validate_slice(obj: dict[str, Any], old: dict[str, Any] | None, minor: int = 37) -> Causes:
    spec = obj.get("spec") or {}
    out: Causes = []
    why = dns_subdomain(spec.get("driver"), 63)
    if why:
        out.append(("spec.driver", why))
    pool = spec.get("pool") or {}
    pool_name = pool.get("name")
    if not isinstance(pool_name, str) or not pool_name or len(pool_name) > 253:
        out.append(("spec.pool.name", "required, at most 253 characters"))
    else:
        out += [
            ("spec.pool.name", f"segment {seg!r}: {why}") for seg in pool_name.split("/") if (why := dns_subdomain(seg))
        ]
    if not isinstance(pool.get("generation"), int) or pool["generation"] < 0:
        out.append(("spec.pool.generation", "must be greater than or equal to 0"))
    if not isinstance(pool.get("resourceSliceCount"), int) or pool["resourceSliceCount"] <= 0:
        out.append(("spec.pool.resourceSliceCount", "must be greater than 0"))
    out += _node_selection("spec", spec, (*_NODE_FIELDS, "perDeviceNodeSelection"))
    if "perDeviceNodeSelection" in spec and spec["perDeviceNodeSelection"] is False:
        out.append(("spec.perDeviceNodeSelection", "must be true when set"))

    counter_sets: dict[str, set[str]] = {}
    shared = spec.get("sharedCounters") or []
    for i, counter_set in enumerate(shared):
        name = counter_set.get("name")
        if why := dns_label(name):
            out.append((f"spec.sharedCounters[{i}].name", why))
        if name in counter_sets:
            out.append((f"spec.sharedCounters[{i}].name", f"duplicate counter set name {name!r}"))
        out += _counters(f"spec.sharedCounters[{i}].counters", counter_set.get("counters"))
        counter_sets.setdefault(name, set(counter_set.get("counters") or {}))
    total_shared = sum(len(s.get("counters") or {}) for s in shared)
    devices = spec.get("devices") or []
    if minor < 35:
        if total_shared > MAX_SHARED_COUNTERS:
            out.append(
                (
                    "spec.sharedCounters",
                    f"must have at most {MAX_SHARED_COUNTERS} counters over all sets (is {total_shared})",
                )
            )
        max_devices = MAX_DEVICES_PER_SLICE
    else:
        if spec.get("sharedCounters") is not None and spec.get("devices") is not None:
            out.append(("spec", "only one of `sharedCounters` or `devices` is allowed"))
        if len(shared) > MAX_COUNTER_SETS:
            out.append(("spec.sharedCounters", f"must have at most {MAX_COUNTER_SETS} counter sets (is {len(shared)})"))
        out += [
            (f"spec.sharedCounters[{i}].counters", f"must have at most {MAX_COUNTERS_PER_SET} counters")
            for i, s in enumerate(shared)
            if len(s.get("counters") or {}) > MAX_COUNTERS_PER_SET
        ]
        uses = any(d.get("taints") or d.get("consumesCounters") for d in devices)
        max_devices = MAX_DEVICES_WITH_TAINTS_OR_COUNTERS if uses else MAX_DEVICES_PER_SLICE
    if len(devices) > max_devices:
        out.append(("spec.devices", f"must have at most {max_devices} devices (is {len(devices)})"))
    names: set[Any] = set()
    consumptions = 0
    for i, device in enumerate(devices):
        out += _device(f"spec.devices[{i}]", device, bool(spec.get("perDeviceNodeSelection")), counter_sets, minor)
        if device.get("name") in names:
            out.append((f"spec.devices[{i}].name", f"duplicate device name {device.get('name')!r}"))
        names.add(device.get("name"))
        consumptions += sum(len(u.get("counters") or {}) for u in device.get("consumesCounters") or [])
    if minor < 35 and consumptions > MAX_COUNTER_CONSUMPTIONS_PER_SLICE:
        out.append(
            (
                "spec.devices",
                f"must consume at most {MAX_COUNTER_CONSUMPTIONS_PER_SLICE} counters over all "
                f"devices (is {consumptions})",
            )
        )

    if old is not None:
        old_spec = old.get("spec") or {}
        for path, new_value, old_value in (
            ("spec.driver", spec.get("driver"), old_spec.get("driver")),
            ("spec.pool.name", pool_name, (old_spec.get("pool") or {}).get("name")),
            ("spec.nodeName", spec.get("nodeName"), old_spec.get("nodeName")),
        ):
            if new_value != old_value:
                out.append((path, "field is immutable"))
    return out


def _requests(where: str, requests: list[dict[str, Any]]) -> Causes:
    out: Causes = []
    if len(requests) > MAX_REQUESTS:
        out.append((where, f"must have at most {MAX_REQUESTS} requests (is {len(requests)})"))
    names: set[Any] = set()
    for i, request in enumerate(requests):
        at = f"{where}[{i}]"
        if why := dns_label(request.get("name")):
            out.append((f"{at}.name", why))
        if request.get("name") in names:
            out.append((f"{at}.name", f"duplicate request name {request.get('name')!r}"))
        names.add(request.get("name"))
        exactly, first = request.get("exactly"), request.get("firstAvailable")
        if (exactly is None) == (first is None):
            out.append((at, "exactly one of exactly or firstAvailable is required"))
        if exactly is not None:
            out += _exact(f"{at}.exactly", exactly)
        if first is not None:
            if not first or len(first) > MAX_SUBREQUESTS:
                out.append((f"{at}.firstAvailable", f"must have 1 to {MAX_SUBREQUESTS} subrequests"))
            for j, sub in enumerate(first):
                if why := dns_label(sub.get("name")):
                    out.append((f"{at}.firstAvailable[{j}].name", why))
                out += _exact(f"{at}.firstAvailable[{j}]", sub)
    return out


def _exact(where: str, request: dict[str, Any]) -> Causes:
    out: Causes = []
    if why := dns_subdomain(request.get("deviceClassName")):
        out.append((f"{where}.deviceClassName", why))
    mode = request.get("allocationMode", "ExactCount")
    if mode not in ("ExactCount", "All"):
        out.append((f"{where}.allocationMode", "must be ExactCount or All"))
    count = request.get("count")
    if mode == "All" and count is not None:
        out.append((f"{where}.count", "must not be set when allocationMode is All"))
    if mode == "ExactCount" and count is not None and count <= 0:
        out.append((f"{where}.count", "must be greater than zero"))
    out += _selectors(f"{where}.selectors", request.get("selectors") or [])
    for name, value in ((request.get("capacity") or {}).get("requests") or {}).items():
        if why := qualified_name(name):
            out.append((f"{where}.capacity.requests[{name}]", why))
        if _quantity(value) is None:  # a negative one is taken, as by kube-apiserver 1.37 (the node refuses it)
            out.append((f"{where}.capacity.requests[{name}]", "must be a quantity"))
    return out


def _selectors(where: str, selectors: list[dict[str, Any]]) -> Causes:
    out: Causes = []
    if len(selectors) > MAX_SELECTORS:
        out.append((where, f"must have at most {MAX_SELECTORS} selectors"))
    for i, selector in enumerate(selectors):
        expression = (selector.get("cel") or {}).get("expression")
        if not isinstance(expression, str) or not expression.strip():
            out.append((f"{where}[{i}].cel.expression", "required"))
        elif len(expression) > MAX_CEL_LENGTH:
            out.append((f"{where}[{i}].cel.expression", f"must be at most {MAX_CEL_LENGTH} characters"))
        else:
            out += selector_cel.causes(f"{where}[{i}].cel.expression", expression)
    return out


def _configs(where: str, configs: list[dict[str, Any]]) -> Causes:
    out: Causes = []
    if len(configs) > MAX_CONFIGS:
        out.append((where, f"must have at most {MAX_CONFIGS} entries"))
    for i, config in enumerate(configs):
        opaque = config.get("opaque")
        if opaque is None:
            out.append((f"{where}[{i}].opaque", "required"))
            continue
        if why := dns_subdomain(opaque.get("driver"), 63):
            out.append((f"{where}[{i}].opaque.driver", why))
        if opaque.get("parameters") is None:
            out.append((f"{where}[{i}].opaque.parameters", "required"))
        elif len(str(opaque["parameters"])) > MAX_OPAQUE_PARAMETERS:
            out.append((f"{where}[{i}].opaque.parameters", f"must be at most {MAX_OPAQUE_PARAMETERS} bytes"))
    return out


def validate_claim_spec(where: str, spec: dict[str, Any]) -> Causes:
    devices = spec.get("devices") or {}
    out = _requests(f"{where}.devices.requests", devices.get("requests") or [])
    if len(devices.get("constraints") or []) > MAX_CONSTRAINTS:
        out.append((f"{where}.devices.constraints", f"must have at most {MAX_CONSTRAINTS} constraints"))
    out += _configs(f"{where}.devices.config", devices.get("config") or [])
    return out


def _request_names(spec: dict[str, Any]) -> set[str]:
    """What an allocation result may name: a request, or `<request>/<subrequest>` of a firstAvailable one."""
    names = set()
    for request in (spec.get("devices") or {}).get("requests") or []:
        names.add(request.get("name"))
        names.update(f"{request.get('name')}/{sub.get('name')}" for sub in request.get("firstAvailable") or [])
    return names


def validate_claim(obj: dict[str, Any], old: dict[str, Any] | None) -> Causes:
    out = validate_claim_spec("spec", obj.get("spec") or {})
    if old is not None and obj.get("spec") != old.get("spec"):
        out.append(("spec", "field is immutable"))
    status = obj.get("status") or {}
    if len(status.get("reservedFor") or []) > MAX_RESERVED_FOR:
        out.append(("status.reservedFor", f"must have at most {MAX_RESERVED_FOR} entries"))
    results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
    if len(results) > MAX_ALLOCATION_RESULTS:
        out.append(("status.allocation.devices.results", f"must have at most {MAX_ALLOCATION_RESULTS} results"))
    requests = _request_names(obj.get("spec") or {})
    seen: set[tuple[Any, ...]] = set()
    for i, result in enumerate(results):
        if result.get("request") not in requests:
            out.append(
                (
                    f"status.allocation.devices.results[{i}].request",
                    "must be the name of a request in the "
                    "claim or the name of a request and a subrequest separated by '/'",
                )
            )
        if why := dns_label(result.get("device")):
            out.append((f"status.allocation.devices.results[{i}].device", why))
        if why := dns_subdomain(result.get("driver"), 63):
            out.append((f"status.allocation.devices.results[{i}].driver", why))
        share = result.get("shareID")
        if share is not None and not _UID.fullmatch(str(share)):
            out.append((f"status.allocation.devices.results[{i}].shareID", f"invalid UID {share!r}"))
        key = (result.get("driver"), result.get("pool"), result.get("device"), share)
        if key in seen:
            out.append(
                (
                    f"status.allocation.devices.results[{i}]",
                    "Duplicate value: a device (and share) may be allocated once",
                )
            )
        seen.add(key)
    return out


def validate_resource_object(kind: str, obj: dict[str, Any], old: dict[str, Any] | None, minor: int = 37) -> Causes:
    if kind == "ResourceSlice":
        return validate_slice(obj, old, minor)
    if kind == "ResourceClaim":
        return validate_claim(obj, old)
    if kind == "ResourceClaimTemplate":
        return validate_claim_spec("spec.spec", (obj.get("spec") or {}).get("spec") or {})
    if kind == "DeviceClass":
        spec = obj.get("spec") or {}
        return _selectors("spec.selectors", spec.get("selectors") or []) + _configs(
            "spec.config", spec.get("config") or []
        )
    return []
