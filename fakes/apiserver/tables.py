"""Server-side `Table` output (meta.k8s.io/v1), what `kubectl get` prints.

Columns and cells follow upstream's printers (k8s.io/kubernetes pkg/printers/internalversion/printers.go,
AddHandlers and the print<Kind> functions) for the built-in kinds the fake serves; custom resources use their
CRD version's additionalPrinterColumns (apiextensions-apiserver pkg/registry/customresource/tableconvertor) and
kinds without a printer get NAME and AGE, as the default table convertor gives.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Callable
from typing import Any

from agent.jsontypes import Json

from .resources import ResourceType

Column = tuple[str, str, int]  # name, type, priority
_NAME: Column = ("Name", "string", 0)
_AGE: Column = ("Age", "string", 0)


def human_duration(seconds: float) -> str:
    """k8s.io/apimachinery/pkg/util/duration.HumanDuration."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = (hours // 24) % 365
        return f"{hours // 24 // 365}y" if days == 0 else f"{hours // 24 // 365}y{days}d"
    return f"{hours // 24 // 365}y"


def _since(stamp: Any, now: datetime.datetime) -> str:
    if not isinstance(stamp, str) or not stamp:
        return "<unknown>"
    try:
        when = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return "<unknown>"
    return human_duration((now - when).total_seconds())


def _meta(obj: Json) -> Json:
    return obj.get("metadata") or {}


def _spec(obj: Json) -> Json:
    return obj.get("spec") or {}


def _status(obj: Json) -> Json:
    return obj.get("status") or {}


def _claim_state(obj: Json) -> str:
    """resourceClaimState in printers.go."""
    states = []
    deleted = bool(_meta(obj).get("deletionTimestamp"))
    if deleted:
        states.append("deleted")
    if not _status(obj).get("allocation"):
        if not deleted:
            states.append("pending")
    else:
        states.append("allocated")
        if _status(obj).get("reservedFor"):
            states.append("reserved")
    return ",".join(states)


def _pod_cells(obj: Json) -> list[Any]:
    statuses = _status(obj).get("containerStatuses") or []
    containers = _spec(obj).get("containers") or []
    ready = sum(1 for s in statuses if s.get("ready"))
    restarts = sum(int(s.get("restartCount") or 0) for s in statuses)
    reason = _status(obj).get("reason") or _status(obj).get("phase") or ""
    if _meta(obj).get("deletionTimestamp"):
        reason = "Terminating"
    elif reason == "Pending" and _spec(obj).get("schedulingGates"):
        reason = "SchedulingGated"
    return [f"{ready}/{len(containers)}", reason, restarts]


def _pod_wide(obj: Json) -> list[Any]:
    return [
        _status(obj).get("podIP") or "<none>",
        _spec(obj).get("nodeName") or "<none>",
        _status(obj).get("nominatedNodeName") or "<none>",
        "<none>",
    ]


def _selector(spec: Json) -> str:
    labels = (spec.get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "<none>"


def _containers(template: Json) -> list[str]:
    containers = ((template.get("spec") or {}).get("containers")) or []
    return [",".join(c.get("name", "") for c in containers), ",".join(c.get("image", "") for c in containers)]


def _daemonset_cells(obj: Json) -> list[Any]:
    st = _status(obj)
    node_selector = ((_spec(obj).get("template") or {}).get("spec") or {}).get("nodeSelector") or {}
    return [
        int(st.get("desiredNumberScheduled") or 0),
        int(st.get("currentNumberScheduled") or 0),
        int(st.get("numberReady") or 0),
        int(st.get("updatedNumberScheduled") or 0),
        int(st.get("numberAvailable") or 0),
        ",".join(f"{k}={v}" for k, v in sorted(node_selector.items())) or "<none>",
    ]


def _deployment_cells(obj: Json) -> list[Any]:
    st = _status(obj)
    want = int(_spec(obj).get("replicas", 1))
    return [
        f"{int(st.get('readyReplicas') or 0)}/{want}",
        int(st.get("updatedReplicas") or 0),
        int(st.get("availableReplicas") or 0),
    ]


def _binding_role(obj: Json) -> str:
    ref = obj.get("roleRef") or {}
    return f"{ref.get('kind', '')}/{ref.get('name', '')}"


def _param_kind(obj: Json) -> str:
    kind = _spec(obj).get("paramKind")
    return f"{kind.get('apiVersion', '')}/{kind.get('kind', '')}" if kind else "<unset>"


def _param_ref(obj: Json) -> str:
    ref = _spec(obj).get("paramRef")
    if not ref:
        return "<unset>"
    return f"{ref['namespace']}/{ref.get('name', '*')}" if ref.get("namespace") else ref.get("name", "*")


_EVENT_COLUMNS: list[Column] = [
    ("Last Seen", "string", 0),
    ("Type", "string", 0),
    ("Reason", "string", 0),
    ("Object", "string", 0),
    ("Subobject", "string", 1),
    ("Source", "string", 1),
    ("Message", "string", 0),
    ("First Seen", "string", 1),
    ("Count", "string", 1),
    ("Name", "string", 1),
]


def _core_event(obj: Json) -> Json:
    """An events.k8s.io/v1 Event in the core shape (as the server converts both to its internal Event)."""
    if "regarding" not in obj and "note" not in obj and "deprecatedCount" not in obj:
        return obj
    return {
        "metadata": _meta(obj),
        "involvedObject": obj.get("regarding") or {},
        "message": obj.get("note", ""),
        "type": obj.get("type", ""),
        "reason": obj.get("reason", ""),
        "source": obj.get("deprecatedSource") or {},
        "reportingComponent": obj.get("reportingController", ""),
        "reportingInstance": obj.get("reportingInstance", ""),
        "eventTime": obj.get("eventTime"),
        "firstTimestamp": obj.get("deprecatedFirstTimestamp"),
        "lastTimestamp": obj.get("deprecatedLastTimestamp"),
        "count": obj.get("deprecatedCount", 0),
        "series": obj.get("series"),
    }


def _event_cells(obj: Json, now: datetime.datetime) -> list[Any]:
    """printEvent, wide (the server always prints every column; kubectl hides priority 1 without -o wide)."""
    obj = _core_event(obj)
    first = _since(obj.get("firstTimestamp") or obj.get("eventTime"), now)
    last = _since(obj["lastTimestamp"], now) if obj.get("lastTimestamp") else first
    count = int(obj.get("count") or 0)
    series = obj.get("series")
    if series:
        last, count = _since(series.get("lastObservedTime"), now), int(series.get("count") or 0)
    elif count == 0:
        count = 1  # singleton events of the new API have no count
    involved = obj.get("involvedObject") or {}
    kind = str(involved.get("kind", "")).lower()
    target = f"{kind}/{involved['name']}" if involved.get("name") else kind
    source = obj.get("source") or {}
    component = source.get("component") or obj.get("reportingComponent") or ""
    instance = source.get("host") or obj.get("reportingInstance") or ""
    return [
        last,
        obj.get("type", ""),
        obj.get("reason", ""),
        target,
        involved.get("fieldPath", ""),
        f"{component}, {instance}" if instance else component,
        str(obj.get("message", "")).strip(),
        first,
        count,
        _meta(obj).get("name", ""),
    ]


# kind (group, kind) -> (columns between NAME and AGE, cells for them, columns after AGE, cells for them)
Printer = tuple[list[Column], Callable[[Json], list[Any]], list[Column], Callable[[Json], list[Any]]]


def _none(obj: Json) -> list[Any]:
    return []


_PRINTERS: dict[tuple[str, str], Printer] = {
    ("", "Namespace"): ([("Status", "string", 0)], lambda o: [_status(o).get("phase", "")], [], _none),
    ("", "Node"): (
        [("Status", "string", 0), ("Roles", "string", 0)],
        lambda o: [
            "Ready"
            if any(c.get("type") == "Ready" and c.get("status") == "True" for c in _status(o).get("conditions") or [])
            else "NotReady",
            "<none>",
        ],
        [("Version", "string", 0)],
        lambda o: [((_status(o).get("nodeInfo") or {}).get("kubeletVersion")) or ""],
    ),
    ("", "Pod"): (
        [("Ready", "string", 0), ("Status", "string", 0), ("Restarts", "string", 0)],
        _pod_cells,
        [("IP", "string", 1), ("Node", "string", 1), ("Nominated Node", "string", 1), ("Readiness Gates", "string", 1)],
        _pod_wide,
    ),
    ("", "ConfigMap"): (
        [("Data", "integer", 0)],
        lambda o: [len(o.get("data") or {}) + len(o.get("binaryData") or {})],
        [],
        _none,
    ),
    ("", "Secret"): (
        [("Type", "string", 0), ("Data", "string", 0)],
        lambda o: [o.get("type", "Opaque"), len(o.get("data") or {}) + len(o.get("stringData") or {})],
        [],
        _none,
    ),
    ("", "ServiceAccount"): ([("Secrets", "string", 0)], lambda o: [len(o.get("secrets") or [])], [], _none),
    ("apps", "DaemonSet"): (
        [
            ("Desired", "integer", 0),
            ("Current", "integer", 0),
            ("Ready", "integer", 0),
            ("Up-to-date", "integer", 0),
            ("Available", "integer", 0),
            ("Node Selector", "string", 0),
        ],
        _daemonset_cells,
        [("Containers", "string", 1), ("Images", "string", 1), ("Selector", "string", 1)],
        lambda o: [*_containers(_spec(o).get("template") or {}), _selector(_spec(o))],
    ),
    ("apps", "Deployment"): (
        [("Ready", "string", 0), ("Up-to-date", "integer", 0), ("Available", "integer", 0)],
        _deployment_cells,
        [("Containers", "string", 1), ("Images", "string", 1), ("Selector", "string", 1)],
        lambda o: [*_containers(_spec(o).get("template") or {}), _selector(_spec(o))],
    ),
    ("rbac.authorization.k8s.io", "ClusterRoleBinding"): (
        [("Role", "string", 0)],
        lambda o: [_binding_role(o)],
        [],
        _none,
    ),
    ("rbac.authorization.k8s.io", "RoleBinding"): ([("Role", "string", 0)], lambda o: [_binding_role(o)], [], _none),
    ("coordination.k8s.io", "Lease"): (
        [("Holder", "string", 0)],
        lambda o: [_spec(o).get("holderIdentity") or ""],
        [],
        _none,
    ),
    ("admissionregistration.k8s.io", "ValidatingAdmissionPolicy"): (
        [("Validations", "integer", 0), ("ParamKind", "string", 0)],
        lambda o: [len(_spec(o).get("validations") or []), _param_kind(o)],
        [],
        _none,
    ),
    ("admissionregistration.k8s.io", "ValidatingAdmissionPolicyBinding"): (
        [("PolicyName", "string", 0), ("ParamRef", "string", 0)],
        lambda o: [_spec(o).get("policyName", ""), _param_ref(o)],
        [],
        _none,
    ),
    ("admissionregistration.k8s.io", "MutatingAdmissionPolicy"): (
        [("Mutations", "integer", 0), ("ParamKind", "string", 0)],
        lambda o: [len(_spec(o).get("mutations") or []), _param_kind(o)],
        [],
        _none,
    ),
    ("admissionregistration.k8s.io", "MutatingAdmissionPolicyBinding"): (
        [("PolicyName", "string", 0), ("ParamRef", "string", 0)],
        lambda o: [_spec(o).get("policyName", ""), _param_ref(o)],
        [],
        _none,
    ),
    ("resource.k8s.io", "ResourceSlice"): (
        [("Node", "string", 0), ("Driver", "string", 0), ("Pool", "string", 0)],
        lambda o: [
            _spec(o).get("nodeName") or "",
            _spec(o).get("driver", ""),
            (_spec(o).get("pool") or {}).get("name", ""),
        ],
        [],
        _none,
    ),
    ("resource.k8s.io", "ResourceClaim"): ([("State", "string", 0)], lambda o: [_claim_state(o)], [], _none),
}
# Kinds printed with NAME and CREATED AT instead of AGE (printClusterRole, printRole, printCustomResourceDefinition).
_CREATED_AT = {
    ("rbac.authorization.k8s.io", "ClusterRole"),
    ("rbac.authorization.k8s.io", "Role"),
    ("apiextensions.k8s.io", "CustomResourceDefinition"),
}


def _column(name: str, kind: str, priority: int, description: str = "") -> Json:
    out: Json = {
        "name": name,
        "type": kind,
        "format": "name" if name == "Name" else "",
        "description": description,
        "priority": priority,
    }
    return out


def _path_value(obj: Any, path: str) -> Any:
    """The first value a CRD column's JSONPath (.a.b, .a[0], .a[?(@.k=="v")].b) selects, or None."""
    for token in re.findall(r"\.([^.\[\]]+)|\[(\d+)\]|\[\?\(@\.([^=]+)==[\"']([^\"']*)[\"']\)\]", path):
        key, index, filter_key, filter_value = token
        if key:
            obj = obj.get(key) if isinstance(obj, dict) else None
        elif index:
            obj = obj[int(index)] if isinstance(obj, list) and int(index) < len(obj) else None
        else:
            obj = (
                next((i for i in obj if isinstance(i, dict) and str(i.get(filter_key)) == filter_value), None)
                if isinstance(obj, list)
                else None
            )
        if obj is None:
            return None
    return obj


def _custom_cell(column: Json, value: Any, now: datetime.datetime) -> Any:
    if value is None:
        return None
    if column.get("type") == "date":
        return _since(value, now)
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return value


def _row_object(obj: Json, include: str) -> Json | None:
    if include == "None":
        return None
    if include == "Object":
        return obj
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": _meta(obj)}


def table(
    rt: ResourceType,
    objects: list[Json],
    *,
    resource_version: str = "",
    include: str = "Metadata",
    list_meta: Json | None = None,
    now: datetime.datetime | None = None,
) -> Json:
    """A meta.k8s.io/v1 Table of `objects` of type rt, with upstream's columns for it."""
    now = now or datetime.datetime.now(datetime.UTC)
    columns: list[Column]
    cells: Callable[[Json], list[Any]]
    if not rt.builtin:
        custom = list(rt.columns) or [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        definitions = [_column("Name", "string", 0)] + [
            _column(c["name"], c.get("type", "string"), int(c.get("priority", 0)), c.get("description", ""))
            for c in custom
        ]

        def cells(o: Json) -> list[Any]:
            return [_meta(o).get("name", "")] + [
                _custom_cell(c, _path_value(o, c.get("jsonPath", "")), now) for c in custom
            ]
    elif rt.kind == "Event" and rt.group in ("", "events.k8s.io"):  # no NAME first, no AGE: printEvent's own
        definitions = [_column(*c) for c in _EVENT_COLUMNS]

        def cells(o: Json) -> list[Any]:
            return _event_cells(o, now)
    elif (rt.group, rt.kind) in _CREATED_AT:
        definitions = [_column("Name", "string", 0), _column("Created At", "date", 0)]

        def cells(o: Json) -> list[Any]:
            return [_meta(o).get("name", ""), _meta(o).get("creationTimestamp", "")]
    else:
        before, before_cells, after, after_cells = _PRINTERS.get((rt.group, rt.kind), ([], _none, [], _none))
        columns = [_NAME, *before, _AGE, *after]
        definitions = [_column(*c) for c in columns]

        def cells(o: Json) -> list[Any]:
            return [
                _meta(o).get("name", ""),
                *before_cells(o),
                _since(_meta(o).get("creationTimestamp"), now),
                *after_cells(o),
            ]

    rows = []
    for obj in objects:
        row: Json = {"cells": cells(obj)}
        shown = _row_object(obj, include)
        if shown is not None:
            row["object"] = shown
        rows.append(row)
    meta = dict(list_meta or {})
    if resource_version:
        meta["resourceVersion"] = resource_version
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": meta,
        "columnDefinitions": definitions,
        "rows": rows,
    }


def wants_table(accept: str) -> bool:
    """Whether an Accept header asks for a meta.k8s.io/v1 Table (kubectl get's first choice)."""
    for part in accept.split(","):
        params = dict(p.strip().partition("=")[::2] for p in part.split(";")[1:])
        if params.get("as") == "Table" and params.get("v", "v1") == "v1" and params.get("g") == "meta.k8s.io":
            return True
    return False
