"""Fault injection of the NVML fake: events, lost GPUs, forced errors, missing functions, processes."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pynvml as N
import pytest

import fakes.nvml as fake_nvml


@pytest.fixture
def nvml() -> Iterator[fake_nvml.FakeNvml]:
    with fake_nvml.install("dgx-h100") as fake:
        N.nvmlInit()
        yield fake
        N.nvmlShutdown()


def xid_set(index: int) -> object:
    h = N.nvmlDeviceGetHandleByIndex(index)
    events = N.nvmlEventSetCreate()
    N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError & N.nvmlDeviceGetSupportedEventTypes(h), events)
    return events


def test_xid_is_delivered_once_then_wait_times_out(nvml: fake_nvml.FakeNvml) -> None:
    events = xid_set(3)
    assert nvml.inject_xid(3, 48) == 1
    assert nvml.inject_xid(5, 31) == 0  # nobody listens on GPU 5
    data = N.nvmlEventSetWait_v2(events, 100)
    assert (data.eventType, data.eventData) == (N.nvmlEventTypeXidCriticalError, 48)
    assert N.nvmlDeviceGetIndex(data.device) == 3
    assert (data.gpuInstanceId, data.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    with pytest.raises(N.NVMLError_Timeout):
        N.nvmlEventSetWait_v2(events, 0)
    N.nvmlEventSetFree(events)
    # Trying to wait on a freed set.
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlEventSetWait_v2(events, 0)


def test_wait_wakes_up_when_an_event_arrives_from_another_thread(nvml: fake_nvml.FakeNvml) -> None:
    events = xid_set(0)
    timer = threading.Timer(0.05, nvml.inject_xid, args=(0, 94))
    timer.start()
    data = N.nvmlEventSetWait_v2(events, 5000)
    timer.join()
    assert data.eventData == 94


def test_registering_unsupported_event_types_fails(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(0)
    events = N.nvmlEventSetCreate()
    # Trying to register every event type without masking with the supported ones.
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeAll, events)
    assert N.nvmlDeviceGetSupportedEventTypes(h) & N.nvmlEventTypeXidCriticalError


def test_lost_gpu_fails_every_call_but_others_keep_working(nvml: fake_nvml.FakeNvml) -> None:
    events = xid_set(2)
    h = N.nvmlDeviceGetHandleByIndex(2)
    nvml.lose_gpu(2)
    assert N.nvmlEventSetWait_v2(events, 100).eventData == 79  # fallen off the bus
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetUUID(h)
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetHandleByIndex(2)
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetMigMode(h)
    assert N.nvmlDeviceGetCount() == 8
    assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByIndex(3)).startswith("GPU-")


def test_forced_errors_hit_the_next_calls_only(nvml: fake_nvml.FakeNvml) -> None:
    nvml.force_error("nvmlDeviceGetHandleByIndex_v2", N.NVML_ERROR_UNKNOWN, count=2)
    for _ in range(2):
        with pytest.raises(N.NVMLError_Unknown):
            N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByIndex(0)) == 0
    # Trying to force an error on a symbol the library does not have.
    with pytest.raises(ValueError, match="nvmlNoSuchThing"):
        nvml.force_error("nvmlNoSuchThing", N.NVML_ERROR_UNKNOWN)


def test_removed_functions_look_like_an_older_driver(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(0)
    N.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)  # cached by pynvml before removal
    nvml.remove_function("nvmlDeviceGetGpuInstanceProfileInfoV")
    nvml.remove_function("nvmlDeviceGetGpuFabricInfoV")
    with pytest.raises(N.NVMLError_FunctionNotFound):
        N.nvmlDeviceGetGpuInstanceProfileInfo(h, 0)
    with pytest.raises(N.NVMLError_FunctionNotFound):
        N.nvmlDeviceGetGpuFabricInfoV(h, N.byref(N.c_nvmlGpuFabricInfoV_t()))
    assert N.nvmlDeviceGetGpuInstanceProfileInfo(h, 0, version=1).id == 19  # the v1 symbol is still there
    nvml.restore_function("nvmlDeviceGetGpuInstanceProfileInfoV")
    assert N.nvmlDeviceGetGpuInstanceProfileInfo(h, 0).id == 19


def test_processes_show_up_in_process_list_and_memory(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(1)
    assert N.nvmlDeviceGetComputeRunningProcesses(h) == []
    nvml.set_processes(1, [(100, 2 << 30), (101, 1 << 30)])
    procs = N.nvmlDeviceGetComputeRunningProcesses(h)
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(100, 2 << 30), (101, 1 << 30)]
    assert N.nvmlDeviceGetMemoryInfo(h).used == 3 << 30
    # Trying to place a process on a MIG device that does not exist.
    with pytest.raises(ValueError, match="no MIG device"):
        nvml.set_processes(1, [(1, 1)], gpu_instance_id=7, compute_instance_id=0)
    with pytest.raises(ValueError, match="GPUs 0..7"):
        nvml.lose_gpu(8)
