"""NVML health events -> unhealthy devices: the pure mapping, and the monitor against the NVML fake."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import pynvml
import pytest

from agent.devices.model import Inventory
from agent.nvml.health import (
    ALL_INSTANCES,
    APPLICATION_XIDS,
    Fault,
    GpuEvent,
    HealthMonitor,
    affected_devices,
    parent_gpu_name,
    without_devices,
)
from agent.nvml.source import NvmlSource, open_nvml
from agent.slices.build import pool_content
from tests.unit.test_claims_support import inventory, mig

MIG_A = "gpu-4-mig-1g10gb-19-0"  # GI 9, CI 0
MIG_B = "gpu-4-mig-1g10gb-19-1"  # GI 10, CI 0


def xid(minor: int, code: int, gi: int = ALL_INSTANCES, ci: int = ALL_INSTANCES) -> GpuEvent:
    return GpuEvent(minor, Fault.XID, code, gi, ci)


# --- the pure mapping ---------------------------------------------------------------------------------


@pytest.mark.parametrize("code", sorted(APPLICATION_XIDS))
def test_application_xids_affect_nothing(code: int) -> None:
    assert affected_devices(xid(1, code), inventory()) == ()


def test_a_critical_xid_on_a_full_gpu_affects_that_gpu_only() -> None:
    assert affected_devices(xid(1, 79), inventory()) == ("gpu-1",)


def test_extra_ignored_xids_are_honoured() -> None:
    ignored = APPLICATION_XIDS | {79}
    assert affected_devices(xid(1, 79), inventory(), ignored) == ()
    assert affected_devices(xid(1, 48), inventory(), ignored) == ("gpu-1",)


def test_a_gpu_wide_xid_on_a_mig_gpu_affects_every_mig_device() -> None:
    assert affected_devices(xid(4, 48), inventory()) == ("gpu-4", MIG_A, MIG_B)


def test_instance_ids_narrow_an_xid_to_one_mig_device() -> None:
    assert affected_devices(xid(4, 94, gi=10, ci=0), inventory()) == (MIG_B,)
    # a GPU-instance-wide event (no compute instance) hits every MIG device of that GI
    assert affected_devices(xid(4, 94, gi=9), inventory()) == (MIG_A,)


def test_compute_instance_id_picks_one_of_two_mig_devices_in_a_gpu_instance() -> None:
    base = inventory()
    second_ci = dataclasses.replace(mig(4, 9, 0), compute_instance_id=1, placement=mig(4, 9, 3).placement)
    inv = dataclasses.replace(base, mig_devices=(*base.mig_devices, second_ci))
    assert affected_devices(xid(4, 94, gi=9, ci=1), inv) == ("gpu-4-mig-1g10gb-19-3",)
    assert affected_devices(xid(4, 94, gi=9), inv) == (MIG_A, "gpu-4-mig-1g10gb-19-3")


def test_instance_ids_naming_no_known_mig_device_fall_back_to_the_whole_gpu() -> None:
    # e.g. a MIG device created since the last discovery: safer to distrust the GPU than to miss it
    assert affected_devices(xid(4, 94, gi=3, ci=0), inventory()) == ("gpu-4", MIG_A, MIG_B)


def test_a_lost_gpu_affects_it_and_its_mig_devices_whatever_the_ids() -> None:
    lost = GpuEvent(4, Fault.GPU_LOST, gpu_instance_id=9, compute_instance_id=0)
    assert affected_devices(lost, inventory()) == ("gpu-4", MIG_A, MIG_B)
    assert affected_devices(GpuEvent(2, Fault.GPU_LOST), inventory()) == ("gpu-2",)


def test_double_bit_ecc_and_unavailable_gpu_are_critical() -> None:
    assert affected_devices(GpuEvent(0, Fault.DOUBLE_BIT_ECC), inventory()) == ("gpu-0",)
    assert affected_devices(GpuEvent(0, Fault.GPU_UNAVAILABLE), inventory()) == ("gpu-0",)


def test_an_event_on_a_gpu_not_in_the_inventory_affects_nothing() -> None:
    assert affected_devices(xid(42, 79), inventory()) == ()


def test_reasons_name_the_xid_and_say_what_it_means() -> None:
    assert xid(0, 79).reason == "XID 79 (GPU has fallen off the bus)"
    assert xid(0, 1234).reason == "XID 1234"
    assert GpuEvent(0, Fault.GPU_LOST).reason == "GPU lost"


def test_parent_gpu_name() -> None:
    assert parent_gpu_name(MIG_A) == "gpu-4"
    assert parent_gpu_name("gpu-4") is None
    assert parent_gpu_name("not-a-device") is None


def names(inv: Inventory, partitionable: bool = False) -> list[str]:
    return [d["name"] for c in pool_content(inv, partitionable=partitionable) for d in c.devices]


def test_without_devices_leaves_unhealthy_devices_out_of_the_slices() -> None:
    inv = inventory()
    assert names(without_devices(inv, {"gpu-1"})) == ["gpu-0", "gpu-2", "gpu-3", MIG_A, MIG_B]
    assert names(without_devices(inv, {MIG_A})) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", MIG_B]
    # dropping a GPU drops what is carved from it, even when the MIG devices are not named
    assert names(without_devices(inv, {"gpu-4"})) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert without_devices(inv, set()) is inv


# --- the monitor against the NVML fake ------------------------------------------------------------------


class Recorder:
    """The on_change callback: remembers calls and lets a test wait for one, with a bound."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool, str]] = []
        self._changed = threading.Condition()

    def __call__(self, device: str, healthy: bool, reason: str) -> None:
        with self._changed:
            self.calls.append((device, healthy, reason))
            self._changed.notify_all()

    def wait_for(self, device: str, timeout: float = 5.0) -> tuple[str, bool, str]:
        with self._changed:
            assert self._changed.wait_for(lambda: any(c[0] == device for c in self.calls), timeout), (
                f"no health change for {device} within {timeout}s; got {self.calls}"
            )
            return next(c for c in self.calls if c[0] == device)

    @property
    def devices(self) -> list[str]:
        with self._changed:
            return [c[0] for c in self.calls]


@pytest.fixture
def nvml_machine() -> Iterator[Callable[[str], NvmlSource]]:
    """Open a fake machine (one at a time: the fake replaces pynvml's library process-wide)."""
    opened: list[object] = []

    def open_machine(machine: str) -> NvmlSource:
        ctx = open_nvml(f"fake:{machine}")
        opened.append(ctx)
        return ctx.__enter__()

    yield open_machine
    for ctx in reversed(opened):
        ctx.__exit__(None, None, None)  # type: ignore[attr-defined]


@pytest.fixture
def monitors() -> Iterator[list[HealthMonitor]]:
    started: list[HealthMonitor] = []
    yield started
    for m in started:
        m.stop()


def start_monitor(
    source: NvmlSource, monitors: list[HealthMonitor], **options: object
) -> tuple[HealthMonitor, Recorder]:
    inv = source.discover()
    recorder = Recorder()
    monitor = HealthMonitor(lambda: inv, recorder, wait_ms=50, **options)  # type: ignore[arg-type]
    monitor.start()
    monitors.append(monitor)
    return monitor, recorder


def test_a_critical_xid_makes_its_gpu_unhealthy(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]
) -> None:
    source = nvml_machine("dgx-h100")
    monitor, recorder = start_monitor(source, monitors)
    assert monitor.watched == tuple(range(8))
    source.fake.inject_xid(1, 13)  # application error: ignored
    source.fake.inject_xid(3, 79)
    assert recorder.wait_for("gpu-3") == ("gpu-3", False, "XID 79 (GPU has fallen off the bus)")
    source.fake.inject_xid(3, 48)  # already unhealthy: not reported again
    source.fake.inject_xid(5, 31)
    source.fake.inject_xid(6, 48)
    recorder.wait_for("gpu-6")
    assert recorder.devices == ["gpu-3", "gpu-6"]
    assert monitor.unhealthy == {
        "gpu-3": "XID 79 (GPU has fallen off the bus)",
        "gpu-6": "XID 48 (double-bit ECC error)",
    }


def test_events_map_nvml_indexes_to_device_minors(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]
) -> None:
    source = nvml_machine("h100-nvl-x4")  # index 1 has minor 3
    _, recorder = start_monitor(source, monitors)
    source.fake.inject_xid(1, 79)
    recorder.wait_for("gpu-3")
    assert recorder.devices == ["gpu-3"]


def test_extra_ignored_xids(nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]) -> None:
    source = nvml_machine("dgx-h100")
    _, recorder = start_monitor(source, monitors, extra_ignored_xids=[79])
    source.fake.inject_xid(0, 79)
    source.fake.inject_xid(1, 48)
    recorder.wait_for("gpu-1")
    assert recorder.devices == ["gpu-1"]


def test_a_mig_scoped_xid_marks_only_that_mig_device(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]
) -> None:
    source = nvml_machine("mixed-mig")
    inv = source.discover()
    target = inv.mig_devices_of(0)[1]
    _, recorder = start_monitor(source, monitors)
    source.fake.inject_xid(
        0, 94, gpu_instance_id=target.gpu_instance_id, compute_instance_id=target.compute_instance_id
    )
    expected = f"gpu-0-mig-{target.profile.replace('.', '')}-{target.gi_profile_id}-{target.placement.start}"
    recorder.wait_for(expected)
    source.fake.inject_xid(2, 79)  # a later event, to know the first one was fully handled
    recorder.wait_for("gpu-2")
    assert recorder.devices == [expected, "gpu-2"]


def test_a_lost_gpu_without_an_event_is_found_by_probing(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]
) -> None:
    source = nvml_machine("mixed-mig")
    inv = source.discover()
    _, recorder = start_monitor(source, monitors, probe_interval_s=0.05)
    source.fake.lose_gpu(1, xid=None)
    recorder.wait_for("gpu-1")
    mig_names = {
        f"gpu-1-mig-{m.profile.replace('.', '')}-{m.gi_profile_id}-{m.placement.start}" for m in inv.mig_devices_of(1)
    }
    deadline = time.monotonic() + 5
    while set(recorder.devices) != {"gpu-1", *mig_names} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(recorder.devices) == {"gpu-1", *mig_names}
    assert {c[2] for c in recorder.calls} == {"GPU lost"}


def test_without_nvml_events_the_monitor_logs_once_and_still_probes(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor], caplog: pytest.LogCaptureFixture
) -> None:
    source = nvml_machine("dgx-h100")
    source.fake.remove_function("nvmlEventSetCreate")  # an older driver
    with caplog.at_level(logging.WARNING, logger="agent.nvml.health"):
        monitor, recorder = start_monitor(source, monitors, probe_interval_s=0.05)
    assert monitor.watched == ()
    assert [r.getMessage() for r in caplog.records if "running without health events" in r.getMessage()] != []
    assert len(caplog.records) == 1
    source.fake.inject_xid(2, 79)  # nobody registered: nothing arrives
    source.fake.lose_gpu(4, xid=None)
    recorder.wait_for("gpu-4")
    assert recorder.devices == ["gpu-4"]


def test_a_gpu_without_event_support_is_skipped(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]
) -> None:
    source = nvml_machine("dgx-h100")
    source.fake.force_error("nvmlDeviceGetSupportedEventTypes", pynvml.NVML_ERROR_NOT_SUPPORTED)  # the first GPU asked
    monitor, recorder = start_monitor(source, monitors)
    assert monitor.watched == tuple(range(1, 8))
    source.fake.inject_xid(7, 79)
    recorder.wait_for("gpu-7")


def test_a_failing_listener_does_not_stop_monitoring(
    nvml_machine: Callable[[str], NvmlSource], monitors: list[HealthMonitor]
) -> None:
    source = nvml_machine("dgx-h100")
    inv = source.discover()
    recorder = Recorder()

    def listener(device: str, healthy: bool, reason: str) -> None:
        recorder(device, healthy, reason)
        if device == "gpu-0":
            raise RuntimeError("listener bug")

    monitor = HealthMonitor(lambda: inv, listener, wait_ms=50)
    monitor.start()
    monitors.append(monitor)
    source.fake.inject_xid(0, 79)
    source.fake.inject_xid(1, 79)
    recorder.wait_for("gpu-1")


def test_stop_is_prompt_and_frees_the_event_set(nvml_machine: Callable[[str], NvmlSource]) -> None:
    source = nvml_machine("dgx-h100")
    inv = source.discover()
    monitor = HealthMonitor(lambda: inv, Recorder(), wait_ms=100)
    monitor.start()
    assert len(source.fake.library.event_sets) == 1
    began = time.monotonic()
    monitor.stop()
    assert time.monotonic() - began < 1.0
    assert source.fake.library.event_sets == []
