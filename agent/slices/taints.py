"""Device taints for unhealthy GPUs, with the keys NVIDIA's DRA driver publishes (cmd/gpu-kubelet-plugin/
device_health.go, v0.5): `<driver>/xid` with the Xid as value, `<driver>/gpu-lost` without one, both NoSchedule
for faults that make the device unusable. Tolerations written for NVIDIA's driver therefore work unchanged.
Pure: the time is passed in.
"""

from __future__ import annotations

from agent.jsontypes import Json
from agent.times import rfc3339

NO_SCHEDULE = "NoSchedule"
XID_KEY = "xid"
GPU_LOST_KEY = "gpu-lost"
FABRIC_KEY = "fabric"  # ours, in the same family: NVIDIA's driver taints no fabric fault


def xid_taint(driver: str, xid: int, since: float) -> Json:
    """A critical Xid: the GPU (or MIG device) takes no new claims until it recovers."""
    return {"key": f"{driver}/{XID_KEY}", "value": str(xid), "effect": NO_SCHEDULE, "timeAdded": rfc3339(since)}


def gpu_lost_taint(driver: str, since: float) -> Json:
    """The GPU stopped answering NVML (fallen off the bus, or unavailable)."""
    return {"key": f"{driver}/{GPU_LOST_KEY}", "effect": NO_SCHEDULE, "timeAdded": rfc3339(since)}


def fabric_taint(driver: str, fault: str, since: float) -> Json:
    """A GPU whose multi-node NVLink fabric is broken (agent.devices.fabric): it runs, but a job across nodes
    cannot use it, so it takes no new claims until the fabric recovers; the fault is the value."""
    return {"key": f"{driver}/{FABRIC_KEY}", "value": fault, "effect": NO_SCHEDULE, "timeAdded": rfc3339(since)}
