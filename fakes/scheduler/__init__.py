"""A fake of kube-scheduler's DRA allocator: picks devices for a ResourceClaim from ResourceSlices, evaluating
DeviceClass and request CEL selectors in DRA's CEL environment (agent.allocation.cel, on a real CEL library),
and writes the claim's status.allocation.

    allocation = allocate(claim, slices, device_classes, all_claims)          # pure, API JSON dicts
    FakeScheduler(rest).allocate("default", "my-claim")                       # against an API server
"""

from agent.allocation.cel import DeviceSelector, SelectorError, device_variable
from fakes.scheduler.allocator import Unsatisfiable, allocate
from fakes.scheduler.scheduler import FakeScheduler

__all__ = ["DeviceSelector", "FakeScheduler", "SelectorError", "Unsatisfiable", "allocate", "device_variable"]
