"""Device health from NVML events: critical XIDs, double-bit ECC errors and lost GPUs make devices unhealthy.

`affected_devices` is the pure part (one GPU event and the inventory -> the device names it breaks).
`HealthMonitor` registers every full GPU for critical events, waits for them in a thread and reports each
device that turns unhealthy through `on_change(device_name, healthy, reason)`. A device stays unhealthy
until the agent restarts: NVML sends no "recovered" event, and NVIDIA's device plugin behaves the same.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, replace
from typing import Any

import pynvml

from agent.devices.model import Gpu, Inventory
from agent.devices.names import InvalidDeviceName, MigName, gpu_device_name, parse_device_name
from agent.jsontypes import Json
from agent.nvml.errors import FunctionMissing, GpuLost, NvmlError, Timeout, nvml_errors
from agent.slices.taints import gpu_lost_taint, xid_taint

log = logging.getLogger(__name__)

# XIDs caused by the application (illegal address, MMU fault of one context, ...), not by the GPU; the list of
# NVIDIA's k8s-device-plugin (internal/rm/health.go), which its DRA driver uses too.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
ALL_INSTANCES = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId of an event on the whole GPU

# GpuUnavailableError is missing on older drivers; registration ANDs with what each GPU supports.
CRITICAL_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeDoubleBitEccError
    | pynvml.nvmlEventTypeGpuUnavailableError
)

# A few well-known XIDs, so an operator reading the reason needs no table.
_XID_MEANING = {
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

OnChange = Callable[[str, bool, str], None]


class Fault(enum.Enum):
    XID = "xid"
    DOUBLE_BIT_ECC = "double-bit ECC error"
    GPU_UNAVAILABLE = "GPU unavailable"
    GPU_LOST = "GPU lost"


@dataclass(frozen=True)
class GpuEvent:
    """One health event on a full GPU (by minor); instance ids narrow it to MIG devices."""

    gpu_minor: int
    fault: Fault
    xid: int = 0
    gpu_instance_id: int = ALL_INSTANCES
    compute_instance_id: int = ALL_INSTANCES

    @property
    def reason(self) -> str:
        if self.fault is not Fault.XID:
            return str(self.fault.value)
        meaning = _XID_MEANING.get(self.xid)
        return f"XID {self.xid}" + (f" ({meaning})" if meaning else "")


def affected_devices(
    event: GpuEvent, inventory: Inventory, ignored_xids: Set[int] = APPLICATION_XIDS
) -> tuple[str, ...]:
    """The device names an event makes unhealthy: none for an ignored XID or an unknown GPU; the MIG devices
    its GPU/compute instance ids name; otherwise (or when the ids match no MIG device we know) the whole GPU
    and all its MIG devices, since a fault outside any instance affects every one of them."""
    if event.fault is Fault.XID and event.xid in ignored_xids:
        return ()
    gpu = inventory.gpu(event.gpu_minor)
    if gpu is None:
        return ()
    migs = inventory.mig_devices_of(gpu.minor)
    if event.fault not in (Fault.GPU_LOST, Fault.GPU_UNAVAILABLE) and event.gpu_instance_id != ALL_INSTANCES:
        hit = [
            m
            for m in migs
            if m.gpu_instance_id == event.gpu_instance_id
            and event.compute_instance_id in (ALL_INSTANCES, m.compute_instance_id)
        ]
        if hit:
            return tuple(m.name for m in hit)
    return (gpu_device_name(gpu.minor), *(m.name for m in migs))


XID_DOUBLE_BIT_ECC = 48  # the Xid the driver logs for a double-bit ECC error


def device_taint(event: GpuEvent | None, driver: str, since: float) -> Json:
    """The DRA device taint for a fault, keyed as NVIDIA's driver keys it: `<driver>/xid` = the Xid for Xid and
    ECC events, `<driver>/gpu-lost` for a GPU that stopped answering (or an unknown cause)."""
    if event is None or event.fault in (Fault.GPU_LOST, Fault.GPU_UNAVAILABLE):
        return gpu_lost_taint(driver, since)
    return xid_taint(driver, event.xid if event.fault is Fault.XID else XID_DOUBLE_BIT_ECC, since)


def with_gpus_kept(inventory: Inventory, remembered: Iterable[Gpu], names: Set[str]) -> Inventory:
    """The inventory plus the remembered GPUs among `names` that discovery no longer lists (a lost GPU), so
    their device taints stay visible where taints are served, instead of the device silently vanishing."""
    listed = {g.minor for g in inventory.gpus}
    kept = tuple(g for g in remembered if g.minor not in listed and gpu_device_name(g.minor) in names)
    return replace(inventory, gpus=(*inventory.gpus, *kept)) if kept else inventory


def parent_gpu_name(device_name: str) -> str | None:
    """`gpu-3` for `gpu-3-mig-1g10gb-19-0` (so a MIG device shares its GPU's fate); None for a GPU."""
    try:
        parsed = parse_device_name(device_name)
    except InvalidDeviceName:
        return None
    return gpu_device_name(parsed.parent_minor) if isinstance(parsed, MigName) else None


def without_devices(inventory: Inventory, names: Set[str]) -> Inventory:
    """The inventory minus the named GPUs (with everything carved from them) and MIG devices.

    GPU instances stay on their GPU, so a partitionable slice still counts a dropped MIG device's memory
    slices as taken and never offers its placement as free.
    """
    if not names:
        return inventory
    gpus = tuple(g for g in inventory.gpus if gpu_device_name(g.minor) not in names)
    kept = {g.minor for g in gpus}
    migs = tuple(m for m in inventory.mig_devices if m.parent_minor in kept and m.name not in names)
    return replace(inventory, gpus=gpus, mig_devices=migs)


def _fault_of(event_type: int) -> Fault | None:
    if event_type & pynvml.nvmlEventTypeXidCriticalError:
        return Fault.XID
    if event_type & pynvml.nvmlEventTypeDoubleBitEccError:
        return Fault.DOUBLE_BIT_ECC
    if event_type & pynvml.nvmlEventTypeGpuUnavailableError:
        return Fault.GPU_UNAVAILABLE
    return None


def _address(handle: Any) -> int:
    """A device handle's identity: NVML hands out one handle per device, so events compare by address."""
    return int(ctypes.cast(handle, ctypes.c_void_p).value or 0)


class HealthMonitor:
    """Watches every full GPU of the inventory for critical NVML events and probes for lost GPUs.

    `start()` registers for events before it returns (so nothing that happens after it is missed) and then
    waits in a thread with a short timeout, so `stop()` returns within about `wait_ms`.
    """

    def __init__(
        self,
        inventory: Callable[[], Inventory],
        on_change: OnChange,
        *,
        extra_ignored_xids: Iterable[int] = (),
        wait_ms: int = 200,
        probe_interval_s: float = 1.0,
    ) -> None:
        self._inventory = inventory
        self._on_change = on_change
        self.ignored_xids = APPLICATION_XIDS | frozenset(extra_ignored_xids)
        self._wait_ms = wait_ms
        self._probe_interval_s = probe_interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._unhealthy: dict[str, str] = {}
        self._faults: dict[str, GpuEvent] = {}  # the event that made each device unhealthy
        self._event_set: Any = None
        self._by_address: dict[int, int] = {}  # handle address -> GPU minor, for events
        self._handles: dict[int, Any] = {}  # GPU minor -> handle, for lost-GPU probes
        self._lost: set[int] = set()
        self._thread: threading.Thread | None = None

    @property
    def watched(self) -> tuple[int, ...]:
        """Minors of the GPUs registered for events."""
        return tuple(sorted(self._by_address.values()))

    @property
    def unhealthy(self) -> dict[str, str]:
        """Device name -> reason, for every device reported unhealthy so far."""
        with self._lock:
            return dict(self._unhealthy)

    def fault(self, device_name: str) -> GpuEvent | None:
        """The event that made a device unhealthy (the first one: later faults of it are not reported)."""
        with self._lock:
            return self._faults.get(device_name)

    def start(self) -> None:
        self._register(self._inventory())
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)  # the thread frees the event set on its way out
            self._thread = None
        elif self._event_set is not None:
            self._free()

    def report(self, event: GpuEvent) -> tuple[str, ...]:
        """Apply one event: report each device it newly makes unhealthy; the names it affects."""
        if event.fault is Fault.XID and event.xid in self.ignored_xids:
            log.info("ignoring application XID %d on GPU %d", event.xid, event.gpu_minor)
            return ()
        names = affected_devices(event, self._inventory(), self.ignored_xids)
        if not names:
            log.warning("%s on GPU %d matches no known device", event.reason, event.gpu_minor)
        for name in names:
            with self._lock:
                if name in self._unhealthy:
                    continue
                self._unhealthy[name] = event.reason
                self._faults[name] = event
            log.warning(
                "device %s is unhealthy: %s", name, event.reason, extra={"device": name, "reason": event.reason}
            )
            try:
                self._on_change(name, False, event.reason)
            except Exception:  # the listener's bug must not end health monitoring
                log.exception("health listener failed for %s", name)
        return names

    # --- registration -----------------------------------------------------------------------------------

    def _register(self, inventory: Inventory) -> None:
        try:
            with nvml_errors("creating an NVML event set"):
                self._event_set = pynvml.nvmlEventSetCreate()
        except NvmlError as exc:  # NotSupported, FunctionMissing (an old driver), ...: not fatal to the agent
            log.warning("NVML events are not available (%s); running without health events", exc)
        without_events = []
        for gpu in inventory.gpus:
            try:
                with nvml_errors(f"getting the handle of GPU {gpu.minor}"):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                self._handles[gpu.minor] = handle
                if self._event_set is None:
                    continue
                with nvml_errors(f"registering GPU {gpu.minor} for events"):
                    mask = CRITICAL_EVENTS & pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                    if mask:
                        pynvml.nvmlDeviceRegisterEvents(handle, mask, self._event_set)
                if mask:
                    self._by_address[_address(handle)] = gpu.minor
                else:
                    without_events.append(gpu.minor)
            except GpuLost:
                self._mark_lost(gpu.minor)
            except NvmlError as exc:  # NotSupported mostly; the GPU is then only probed
                log.debug("%s", exc)
                without_events.append(gpu.minor)
        if without_events and self._event_set is not None:
            log.warning("GPUs %s offer no critical NVML events; only their loss will be noticed", without_events)
        if not self._by_address and self._event_set is not None:
            self._free()

    def _free(self) -> None:
        event_set, self._event_set = self._event_set, None
        try:
            with nvml_errors("freeing the NVML event set"):
                pynvml.nvmlEventSetFree(event_set)
        except NvmlError as exc:
            log.debug("%s", exc)

    # --- the thread ---------------------------------------------------------------------------------------

    def _run(self) -> None:
        next_probe = time.monotonic() + self._probe_interval_s
        try:
            while not self._stop.is_set():
                if self._event_set is None:
                    self._stop.wait(self._wait_ms / 1000)
                else:
                    self._wait_once()
                if time.monotonic() >= next_probe:
                    self._probe()
                    next_probe = time.monotonic() + self._probe_interval_s
        finally:
            if self._event_set is not None:
                self._free()

    def _wait_once(self) -> None:
        try:
            with nvml_errors("waiting for NVML events"):
                data = pynvml.nvmlEventSetWait_v2(self._event_set, self._wait_ms)
        except Timeout:
            return
        except GpuLost:
            # NVML does not say which GPU; probe them, and if none admits it, distrust them all as the
            # device plugin does.
            if not self._probe():
                for lost in list(self._handles):
                    self._mark_lost(lost)
            return
        except FunctionMissing as exc:
            log.warning("%s; running without health events", exc)
            self._free()
            return
        except NvmlError as exc:
            log.warning("%s; retrying", exc)
            self._stop.wait(self._wait_ms / 1000)  # no busy loop on a persistent error
            return
        minor = self._by_address.get(_address(data.device))
        fault = _fault_of(int(data.eventType))
        if minor is None or fault is None:
            log.debug("NVML event %#x on an unwatched device ignored", int(data.eventType))
            return
        self.report(
            GpuEvent(
                minor,
                fault,
                int(data.eventData) if fault is Fault.XID else 0,
                int(data.gpuInstanceId),
                int(data.computeInstanceId),
            )
        )

    def _probe(self) -> list[int]:
        """A cheap call on every GPU not yet lost; those answering GpuIsLost are reported. Newly lost minors."""
        found = []
        for minor, handle in self._handles.items():
            if minor in self._lost:
                continue
            try:
                with nvml_errors(f"probing GPU {minor}"):
                    pynvml.nvmlDeviceGetUUID(handle)
            except GpuLost:
                self._mark_lost(minor)
                found.append(minor)
            except NvmlError as exc:
                log.debug("%s", exc)
        return found

    def _mark_lost(self, minor: int) -> None:
        if minor not in self._lost:
            self._lost.add(minor)
            self.report(GpuEvent(minor, Fault.GPU_LOST))
