"""What the demo prints: tables and one-line summaries of API objects, for people rather than logs."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agent.claims.types import PrepareResult


def table(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    rows = [list(header), *(list(r) for r in rows)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return [indent + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _attribute(device: Mapping[str, Any], name: str) -> str:
    value = (device.get("attributes") or {}).get(name) or {}
    return str(next(iter(value.values()), "-"))


def device_rows(slices: Iterable[Mapping[str, Any]]) -> list[list[str]]:
    """device, type, product (whole GPU) or profile (MIG), memory, NVLink domain: one row per device."""
    rows = []
    for s in slices:
        for d in s["spec"].get("devices", []):
            kind = _attribute(d, "type")
            what = _attribute(d, "profile") if kind == "mig" else _attribute(d, "productName")
            memory = str(((d.get("capacity") or {}).get("memory") or {}).get("value", "-"))
            rows.append([d["name"], kind, what, memory, _attribute(d, "nvlinkDomain")])
    return rows


def sharing(claim: Mapping[str, Any]) -> str:
    """The sharing a claim's configs ask for, e.g. "MPS" or "TimeSlicing (interval Long)"; "" when none."""
    configs = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("config", [])
    out = []
    for c in configs:
        params = (c.get("opaque") or {}).get("parameters") or {}
        strategy = (params.get("sharing") or {}).get("strategy")
        if strategy == "TimeSlicing":
            interval = (params["sharing"].get("timeSlicingConfig") or {}).get("interval", "Default")
            out.append(f"TimeSlicing (interval {interval})")
        elif strategy == "MPS":
            mps = params["sharing"].get("mpsConfig") or {}
            limits = ", ".join(f"{k.removeprefix('default')} {v}" for k, v in mps.items())
            out.append(f"MPS ({limits})" if limits else "MPS")
    return "; ".join(out)


def node_of(claim: Mapping[str, Any]) -> str:
    """The node a claim's allocation pins it to (the matchFields term kube-scheduler writes)."""
    selector = ((claim.get("status") or {}).get("allocation") or {}).get("nodeSelector") or {}
    for term in selector.get("nodeSelectorTerms", []):
        for f in term.get("matchFields", []):
            if f.get("key") == "metadata.name" and f.get("values"):
                return str(f["values"][0])
    return ""


def prepared_claim(claim: Mapping[str, Any], result: PrepareResult) -> list[str]:
    """A claim, where it runs, each device with its CDI ids, and its sharing."""
    name = claim["metadata"]["name"]
    if result.error:
        return [f"  {name}: prepare FAILED: {result.error}"]
    lines = [f"  {name}  (node {node_of(claim)}, uid {claim['metadata']['uid']})"]
    how = sharing(claim)
    if how:
        lines.append(f"      sharing asked: {how}")
    rows = [[d.device_name, ", ".join(d.request_names) or "*", " ".join(d.cdi_device_ids)] for d in result.devices]
    lines.extend(table(["DEVICE", "REQUEST", "CDI DEVICE IDS"], rows, indent="      "))
    return lines
