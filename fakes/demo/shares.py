"""The demo's shared-GPU scene: small inference claims, each asking `memory: 8Gi` of consumable capacity,
packed onto one H100 by the scheduler (nine fit its 79.6 GiB, the tenth goes to the next GPU), each prepared
as its own CDI device with its memory limit, and what they count for in a queue."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml

from agent.claims import cdi
from agent.claims.types import ClaimRef
from agent.devices import shares
from agent.jsontypes import Json
from fakes.demo import report
from fakes.demo.kubectl import Kubectl
from fakes.demo.node import DRIVER, DemoError, DemoNode
from fakes.scheduler import FakeScheduler

NAMESPACE = "default"
CLAIMS = 10
MEMORY = "8Gi"


def run_share_scene(kubectl: Kubectl, scheduler: FakeScheduler, node: DemoNode, say: Callable[..., None]) -> None:
    """`node` runs with --consumable-shares memory and is registered; claims are made, shown and released."""
    names = []
    for i in range(CLAIMS):
        names.append(
            kubectl.create(
                {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": f"inference-{i}", "namespace": NAMESPACE},
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gpu",
                                    "exactly": {
                                        "deviceClassName": "gpu.nvidia.com",
                                        "capacity": {"requests": {"memory": MEMORY}},
                                    },
                                }
                            ]
                        }
                    },
                }
            )["metadata"]["name"]
        )
    rows = []
    gpu_memory: dict[str, int] = {}
    for d in node_devices(kubectl, node.name):
        gpu_memory[d["name"]] = int(shares.Capacity.from_json(d["capacity"]["memory"]).value)
    held: dict[str, float] = {}
    allocated: list[Json] = []
    for name in names:
        claim = scheduler.allocate(NAMESPACE, name, node=node.name)
        allocated.append(claim)
        [result] = claim["status"]["allocation"]["devices"]["results"]
        ref = ClaimRef(NAMESPACE, claim["metadata"]["uid"], name)
        prepared = node.kubelet.prepare(DRIVER, [ref])[ref.uid]
        if prepared.error:
            raise DemoError(f"prepare of {name} failed: {prepared.error}")
        spec = yaml.safe_load((node.cdi_root / cdi.spec_file_name(ref.uid)).read_text())
        env = [e for d in spec["devices"] for e in d["containerEdits"].get("env", []) if "MEM_LIMIT" in e]
        consumed = result.get("consumedCapacity") or {}
        device = result["device"]
        fraction = shares.gpu_fraction(shares.consumed_of(consumed).get(shares.MEMORY, 0), gpu_memory[device])
        held[device] = held.get(device, 0.0) + fraction
        rows.append(
            [
                name,
                MEMORY,
                device,
                result["shareID"][:8],
                shares.describe(shares.consumed_of(consumed)),
                f"{fraction:.3f}",
                env[0].split("=", 1)[1] if env else "-",
                _short_id(prepared.devices[0].cdi_device_ids[0], ref.uid, result["shareID"]),
            ]
        )
    say(
        *report.table(
            ["CLAIM", "ASKED", "GPU", "SHARE", "CONSUMED", "GPU FRACTION", "MEMORY LIMIT (MPS)", "CDI DEVICE"],
            rows,
            indent="    ",
        )
    )
    gib = {d: m / (1 << 30) for d, m in gpu_memory.items()}
    say(
        *(
            f"  {device}: {sum(1 for r in rows if r[2] == device)} share(s), {fraction:.3f} of the GPU "
            f"({sum(8 for r in rows if r[2] == device)} of {gib[device]:.1f} GiB) in the queue"
            for device, fraction in sorted(held.items())
        )
    )
    for claim in allocated:
        ref = ClaimRef(NAMESPACE, claim["metadata"]["uid"], claim["metadata"]["name"])
        if node.kubelet.unprepare(DRIVER, [ref]).get(ref.uid):
            raise DemoError(f"unprepare of {ref.name} failed")
        scheduler.deallocate(NAMESPACE, ref.name)
    left = sorted(p.name for p in Path(node.cdi_root).iterdir())
    say(f"  all {CLAIMS} unprepared and deallocated; CDI dir of {node.name}: {', '.join(left) or 'empty'}")
    if left:
        raise DemoError(f"CDI specs left after unprepare: {left}")


def node_devices(kubectl: Kubectl, node: str) -> list[Json]:
    return [
        d
        for s in kubectl.list("ResourceSlice", field_selector=f"spec.nodeName={node}")
        for d in s["spec"].get("devices", [])
    ]


def _short_id(cdi_id: str, uid: str, share_id: str) -> str:
    """`k8s.gpu.nvidia.com/claim=<uid>-gpu-0-<shareID>` with both UIDs cut to 8 characters, for the table."""
    return cdi_id.split("=", 1)[1].replace(uid, uid[:8] + "..").replace(share_id, share_id[:8] + "..")
