"""The sharing plan: what a claim's TimeSlicing / MPS configs ask of the node (pure)."""

from __future__ import annotations

import pytest

from agent.claimconfig.config import (
    GPU_CONFIG,
    MIG_DEVICE_CONFIG,
    DeviceConfig,
    Interval,
    Mps,
    TimeSlicing,
    parse_quantity,
)
from agent.sharing.plan import MpsPlan, SharedDevice, SharingConfigError, SharingPlan, plan_sharing

GPU0, GPU1, MIG0 = "GPU-0", "GPU-1", "MIG-0"


def full(name: str, uuid: str, sharing: object = None, limit: str | None = None) -> SharedDevice:
    q = parse_quantity(limit) if limit else None
    return SharedDevice(name, uuid, uuid, DeviceConfig(GPU_CONFIG, sharing, q))  # type: ignore[arg-type]


def mig(sharing: object) -> SharedDevice:
    return SharedDevice("gpu-0-mig-1g10gb-19-0", MIG0, GPU0, DeviceConfig(MIG_DEVICE_CONFIG, sharing))  # type: ignore[arg-type]


def test_time_slicing_sets_each_gpu_to_its_interval() -> None:
    plan = plan_sharing([full("gpu-0", GPU0, TimeSlicing(Interval.LONG)), full("gpu-1", GPU1, TimeSlicing())])
    assert plan == SharingPlan(timeslices=((GPU0, 3), (GPU1, 0)))


def test_no_sharing_is_an_empty_plan() -> None:
    assert plan_sharing([full("gpu-0", GPU0)]).empty


@pytest.mark.parametrize("interval", [None, Interval.SHORT], ids=["mig-config", "gpu-config-on-mig"])
def test_a_mig_device_asked_to_time_slice_gets_no_time_slice_and_is_not_refused(interval: Interval | None) -> None:
    # Tried: MigDeviceConfig with strategy TimeSlicing. Before, the plan refused it ("MIG devices cannot be
    # time-sliced") and the pod stayed in ContainerCreating; NVIDIA's driver accepts it and sets nothing.
    plan = plan_sharing([mig(TimeSlicing(interval)), full("gpu-1", GPU1, TimeSlicing(Interval.SHORT))])
    assert plan == SharingPlan(timeslices=((GPU1, 1),))  # the MIG device's parent GPU keeps its time slice


def test_mps_serves_every_mps_device_with_per_device_limits_in_mib() -> None:
    mps = Mps(active_thread_percentage=50, pinned_memory_limit=parse_quantity("10Gi"))
    plan = plan_sharing([full("gpu-0", GPU0, mps, "10Gi"), full("gpu-1", GPU1, mps, "512Mi"), mig(mps)])
    assert plan.mps == MpsPlan(
        devices=(GPU0, GPU1, MIG0),
        exclusive_gpus=(GPU0, GPU1),  # the MIG device's parent keeps its compute mode
        active_thread_percentage=50,
        pinned_memory_mib=((GPU0, 10240), (GPU1, 512)),
    )
    assert plan.timeslices == ()


def test_one_daemon_cannot_take_two_thread_percentages() -> None:
    devices = [
        full("gpu-0", GPU0, Mps(active_thread_percentage=50)),
        full("gpu-1", GPU1, Mps(active_thread_percentage=20)),
    ]
    with pytest.raises(SharingConfigError, match=r"different defaultActiveThreadPercentage values \(20, 50\)"):
        plan_sharing(devices)


def test_a_pinned_limit_below_one_mib_is_refused() -> None:
    with pytest.raises(SharingConfigError, match=r"gpu-0: MPS pinned memory limit '1Ki' is below 1Mi"):
        plan_sharing([full("gpu-0", GPU0, Mps(), "1Ki")])
