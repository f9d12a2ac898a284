"""The fake libnvidia-ml: one method per C symbol, taking C-style arguments and raising NvmlFail.

`FakeLibrary.symbols()` exports them as plain functions returning nvmlReturn_t codes, the shape pynvml
expects from `CDLL("libnvidia-ml.so.1")`. Handles are opaque addresses kept in a table.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import pynvml as N

from fakes.nvml import cabi as C
from fakes.nvml import persist
from fakes.nvml.machines import Machine
from fakes.nvml.products import BRAND_NVIDIA, Profile
from fakes.nvml.state import ALL_INSTANCES, ComputeInstance, FabricState, FakeGpu, GpuInstance, NvmlFail

MAX_MIG_DEVICES = 7
SUPPORTED_EVENTS = (
    N.nvmlEventTypeSingleBitEccError
    | N.nvmlEventTypeDoubleBitEccError
    | N.nvmlEventTypePState
    | N.nvmlEventTypeXidCriticalError
    | N.nvmlEventTypeClock
)
_ERROR_STRINGS = {
    N.NVML_SUCCESS: "Success",
    N.NVML_ERROR_UNINITIALIZED: "Uninitialized",
    N.NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    N.NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    N.NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    N.NVML_ERROR_NOT_FOUND: "Not Found",
    N.NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
    N.NVML_ERROR_TIMEOUT: "Timeout",
    N.NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
    N.NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    N.NVML_ERROR_RESET_REQUIRED: "GPU requires reset",
    N.NVML_ERROR_IN_USE: "In use by another client",
    N.NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient resources",
    N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
    N.NVML_ERROR_UNKNOWN: "Unknown Error",
}
_Instance = TypeVar("_Instance", GpuInstance, ComputeInstance)
# Symbols that work before nvmlInit, as in the real library.
_NO_INIT = {"nvmlInit_v2", "nvmlInitWithFlags", "nvmlErrorString"}
# Symbols that change GPU state: with a state file they run under its write lock and save what they did.
_MUTATING = {
    "nvmlDeviceSetComputeMode",
    "nvmlDeviceSetMigMode",
    "nvmlDeviceCreateGpuInstance",
    "nvmlDeviceCreateGpuInstanceWithPlacement",
    "nvmlGpuInstanceDestroy",
    "nvmlGpuInstanceCreateComputeInstance",
    "nvmlGpuInstanceCreateComputeInstanceWithPlacement",
    "nvmlComputeInstanceDestroy",
}
# How often a wait on an event set looks for events other processes queued in the state file.
STATE_POLL_S = 0.05


class MigDevice:
    """The device handle of a MIG device: a separate handle kind from the CI it wraps."""

    def __init__(self, ci: ComputeInstance) -> None:
        self.ci = ci


class EventSet:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # GPU index -> event mask
        self.queue: collections.deque[tuple[int, int, int, int, int]] = collections.deque()
        self.ready = threading.Condition()


class Handles:
    """Opaque handle values for fake objects; one stable address per (kind, object)."""

    def __init__(self) -> None:
        self._objects: dict[int, tuple[str, object]] = {}
        self._addresses: dict[tuple[str, int], int] = {}
        self._next = 0x7F00_0000_1000

    def of(self, kind: str, obj: object) -> int:
        key = (kind, id(obj))
        if key not in self._addresses:
            self._addresses[key] = self._next
            self._objects[self._next] = (kind, obj)
            self._next += 0x100
        return self._addresses[key]

    def resolve(self, handle: Any) -> tuple[str, object]:
        found = self._objects.get(C.address(handle))
        if found is None:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        return found

    def forget(self, kind: str, obj: object) -> None:
        addr = self._addresses.pop((kind, id(obj)), None)
        if addr is not None:
            del self._objects[addr]


class FakeLibrary:
    def __init__(self, machine: Machine, state: persist.StateFile | None = None) -> None:
        self.machine = machine
        self.gpus = [FakeGpu(machine, i, spec) for i, spec in enumerate(machine.gpus)]
        self.handles = Handles()
        self.event_sets: list[EventSet] = []
        self.init_count = 0
        self.forced: dict[str, list[int]] = {}  # symbol -> [return code, calls left]
        self.lock = threading.RLock()
        self._mig_devices: dict[int, MigDevice] = {}
        self.state = state
        self.pending: list[persist.PendingEvent] = []  # events queued in the state file for a listener
        if state is not None:
            with state.exclusive():
                data = state.read()
                if data is None:  # a new state starts from the machine profile
                    self.save()
                else:
                    self._load(data)

    # --- the state file -------------------------------------------------------------------------------

    def _load(self, data: dict[str, object]) -> None:
        self.pending = persist.load(data, self.machine.name, self.gpus)

    def save(self) -> None:
        assert self.state is not None
        self.state.write(persist.dump(self.machine.name, self.gpus, self.pending))

    def refresh(self) -> None:
        """Catch up with changes other processes made to the state file (no-op without one)."""
        if self.state is None:
            return
        data = self.state.read_if_changed()
        if data is not None:
            self._load(data)
        for gpu in self.gpus:
            if any(p.tracked for p in gpu.processes):
                gpu.processes = [p for p in gpu.processes if not p.tracked or _pid_alive(p.pid)]

    @contextlib.contextmanager
    def mutation(self) -> Iterator[None]:
        """Change GPU state: under the library lock and the state file's write lock, saved when done."""
        with self.lock:
            if self.state is None:
                yield
                return
            with self.state.exclusive():
                self.refresh()
                yield
                self.save()

    # --- export ---------------------------------------------------------------------------------------

    def symbols(self) -> dict[str, Callable[..., Any]]:
        """Every C symbol as a plain function (pynvml sets attributes such as .restype on them)."""
        return {name: self._export(name) for name in dir(type(self)) if name.startswith("nvml")}

    def _export(self, name: str) -> Callable[..., Any]:
        impl = getattr(self, name)
        waits = name.startswith("nvmlEventSetWait")

        def symbol(*args: Any) -> Any:
            if name == "nvmlErrorString":
                return impl(*args)
            forced = self.forced.get(name)
            if forced and forced[1] > 0:
                forced[1] -= 1
                return forced[0]
            if name not in _NO_INIT and self.init_count == 0:
                return N.NVML_ERROR_UNINITIALIZED
            try:
                if waits:  # blocks on its own condition; must not hold the library lock
                    impl(*args)
                elif name in _MUTATING:
                    with self.mutation():
                        impl(*args)
                else:
                    with self.lock:
                        self.refresh()
                        impl(*args)
            except NvmlFail as e:
                return e.code
            return N.NVML_SUCCESS

        symbol.__name__ = symbol.__qualname__ = name
        return symbol

    # --- handle helpers -------------------------------------------------------------------------------

    def _alive(self, gpu: FakeGpu) -> FakeGpu:
        if gpu.lost:
            raise NvmlFail(N.NVML_ERROR_GPU_IS_LOST)
        return gpu

    def _device(self, handle: Any) -> FakeGpu | MigDevice:
        kind, obj = self.handles.resolve(handle)
        if kind == "gpu":
            return self._alive(obj)  # type: ignore[arg-type]
        if kind == "mig":
            assert isinstance(obj, MigDevice)
            self._alive(obj.ci.gpu)
            if not obj.ci.exists:
                raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)  # destroyed since
            return obj
        raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)

    def _gpu(self, handle: Any) -> FakeGpu:
        """A full-GPU handle; a MIG handle is NotSupported where only parents make sense."""
        dev = self._device(handle)
        if isinstance(dev, MigDevice):
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def _gpu_or_parent(self, handle: Any) -> FakeGpu:
        dev = self._device(handle)
        return dev.ci.gpu if isinstance(dev, MigDevice) else dev

    def _gi(self, handle: Any) -> GpuInstance:
        return self._instance(handle, GpuInstance)

    def _ci(self, handle: Any) -> ComputeInstance:
        return self._instance(handle, ComputeInstance)

    def _instance(self, handle: Any, cls: type[_Instance]) -> _Instance:
        """The GI or CI behind a handle of that kind, while it exists on a GPU that is not lost."""
        _, obj = self.handles.resolve(handle)
        if not isinstance(obj, cls):
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        self._alive(obj.gpu)
        if not obj.exists:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)  # destroyed since
        return obj

    def _put_handles(self, out: Any, count_ref: Any, kind: str, objects: Sequence[object]) -> None:
        """Fill a caller array with handles (when given one) and set the count, as the Get*Instances calls do."""
        if out is not None:
            if C.array_capacity(out) < len(objects):
                raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_SIZE)
            array = C.target(out)
            for i, obj in enumerate(objects):
                C.put_array_handle(array, i, self.handles.of(kind, obj))
        C.put(count_ref, len(objects))

    def mig_device(self, ci: ComputeInstance) -> MigDevice:
        if id(ci) not in self._mig_devices:
            self._mig_devices[id(ci)] = MigDevice(ci)
        return self._mig_devices[id(ci)]

    def _mig_handle(self, ci: ComputeInstance) -> int:
        return self.handles.of("mig", self.mig_device(ci))

    # --- init and system ------------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: Any) -> None:
        self.init_count += 1

    def nvmlInit_v2(self) -> None:
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self.init_count -= 1

    def nvmlErrorString(self, code: Any) -> bytes:
        return _ERROR_STRINGS.get(C.value(code), "Unknown Error").encode()

    def nvmlSystemGetDriverVersion(self, buf: Any, length: Any) -> None:
        C.put_string(buf, length, self.machine.driver_version)

    def nvmlSystemGetNVMLVersion(self, buf: Any, length: Any) -> None:
        C.put_string(buf, length, f"{self.machine.cuda_driver_version // 1000}.{self.machine.driver_version}")

    def nvmlSystemGetCudaDriverVersion(self, ref: Any) -> None:
        C.put(ref, self.machine.cuda_driver_version)

    nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion

    def nvmlSystemGetProcessName(self, pid: Any, buf: Any, length: Any) -> None:
        wanted = C.value(pid)
        for gpu in self.gpus:
            for p in gpu.processes:
                if p.pid == wanted:
                    C.put_string(buf, length, p.name or f"/usr/bin/process-{wanted}")
                    return
        raise NvmlFail(N.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetCount_v2(self, ref: Any) -> None:
        C.put(ref, len(self.gpus))

    # --- handles --------------------------------------------------------------------------------------

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> None:
        i = C.value(index)
        if not 0 <= i < len(self.gpus):
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        C.put_handle(ref, self.handles.of("gpu", self._alive(self.gpus[i])))

    def nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> None:
        text = C.text(uuid)
        for gpu in self.gpus:
            if gpu.uuid == text:
                C.put_handle(ref, self.handles.of("gpu", self._alive(gpu)))
                return
            for ci in gpu.mig_devices():
                if ci.uuid == text:
                    C.put_handle(ref, self._mig_handle(ci))
                    return
        raise NvmlFail(N.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus_id: Any, ref: Any) -> None:
        wanted = _parse_bus_id(C.text(bus_id))
        for gpu in self.gpus:
            if _parse_bus_id(gpu.bus_id) == wanted:
                C.put_handle(ref, self.handles.of("gpu", self._alive(gpu)))
                return
        raise NvmlFail(N.NVML_ERROR_NOT_FOUND)

    # --- identity -------------------------------------------------------------------------------------

    def nvmlDeviceGetIndex(self, h: Any, ref: Any) -> None:
        C.put(ref, self._gpu(h).index)

    def nvmlDeviceGetMinorNumber(self, h: Any, ref: Any) -> None:
        C.put(ref, self._gpu(h).minor)

    def nvmlDeviceGetUUID(self, h: Any, buf: Any, length: Any) -> None:
        dev = self._device(h)
        C.put_string(buf, length, dev.ci.uuid if isinstance(dev, MigDevice) else dev.uuid)

    def nvmlDeviceGetName(self, h: Any, buf: Any, length: Any) -> None:
        dev = self._device(h)
        if isinstance(dev, MigDevice):
            C.put_string(buf, length, f"{dev.ci.gpu.product.name} MIG {dev.ci.profile.name}")
        else:
            C.put_string(buf, length, dev.product.name)

    def nvmlDeviceGetSerial(self, h: Any, buf: Any, length: Any) -> None:
        gpu = self._gpu(h)
        C.put_string(buf, length, f"1650{int(gpu.uuid[4:12], 16) % 10**9:09d}")

    def nvmlDeviceGetBrand(self, h: Any, ref: Any) -> None:
        self._gpu_or_parent(h)
        C.put(ref, BRAND_NVIDIA)

    def nvmlDeviceGetArchitecture(self, h: Any, ref: Any) -> None:
        C.put(ref, self._gpu_or_parent(h).product.architecture)

    def nvmlDeviceGetCudaComputeCapability(self, h: Any, major: Any, minor: Any) -> None:
        cc = self._gpu_or_parent(h).product.compute_capability
        C.put(major, cc[0])
        C.put(minor, cc[1])

    def nvmlDeviceGetPersistenceMode(self, h: Any, ref: Any) -> None:
        self._gpu(h)
        C.put(ref, 1)

    def nvmlDeviceGetNumaNodeId(self, h: Any, ref: Any) -> None:
        C.put(ref, self._gpu(h).spec.numa_node)

    def nvmlDeviceGetPciInfo_v3(self, h: Any, ref: Any) -> None:
        gpu = self._gpu_or_parent(h)
        _fill_pci(C.target(ref), gpu.bus_id, gpu.product.pci_device_id)

    def _memory(self, h: Any) -> tuple[int, int]:
        dev = self._device(h)
        if isinstance(dev, MigDevice):
            return dev.ci.gpu_instance.profile.memory_mib << 20, sum(p.used_bytes for p in dev.ci.processes)
        return dev.product.memory_mib << 20, sum(p.used_bytes for p in dev.processes)

    def nvmlDeviceGetMemoryInfo(self, h: Any, ref: Any) -> None:
        total, used = self._memory(h)
        C.fill(C.target(ref), total=total, used=used, free=total - used)

    def nvmlDeviceGetMemoryInfo_v2(self, h: Any, ref: Any) -> None:
        info = C.target(ref)
        C.check_version(info, N.nvmlMemory_v2)
        total, used = self._memory(h)
        C.fill(info, total=total, reserved=0, used=used, free=total - used)

    # --- compute mode and processes -------------------------------------------------------------------

    def nvmlDeviceGetComputeMode(self, h: Any, ref: Any) -> None:
        C.put(ref, self._gpu(h).compute_mode)

    def nvmlDeviceSetComputeMode(self, h: Any, mode: Any) -> None:
        gpu, m = self._gpu(h), C.value(mode)
        if m not in (
            N.NVML_COMPUTEMODE_DEFAULT,
            N.NVML_COMPUTEMODE_EXCLUSIVE_THREAD,
            N.NVML_COMPUTEMODE_PROHIBITED,
            N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        ):
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        gpu.compute_mode = m

    def nvmlDeviceGetComputeRunningProcesses_v3(self, h: Any, count_ref: Any, infos: Any) -> None:
        dev = self._device(h)
        procs = dev.ci.processes if isinstance(dev, MigDevice) else dev.processes
        count = C.target(count_ref)
        capacity = count.value
        count.value = len(procs)
        if infos is None or capacity < len(procs):
            if procs:
                raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_SIZE)
            return
        array = C.target(infos)
        for i, p in enumerate(procs):
            C.fill(
                array[i],
                pid=p.pid,
                usedGpuMemory=p.used_bytes,
                gpuInstanceId=p.gpu_instance_id,
                computeInstanceId=p.compute_instance_id,
            )

    # --- topology and NVLink --------------------------------------------------------------------------

    def nvmlDeviceGetTopologyCommonAncestor(self, a: Any, b: Any, ref: Any) -> None:
        ga, gb = self._gpu(a), self._gpu(b)
        if ga is gb:
            level = N.NVML_TOPOLOGY_INTERNAL
        elif ga.spec.pcie_switch == gb.spec.pcie_switch and ga.spec.numa_node == gb.spec.numa_node:
            level = N.NVML_TOPOLOGY_SINGLE
        elif ga.spec.numa_node == gb.spec.numa_node:
            level = N.NVML_TOPOLOGY_NODE
        else:
            level = N.NVML_TOPOLOGY_SYSTEM
        C.put(ref, level)

    def _link(self, h: Any, link: Any) -> Any:
        gpu, n = self._gpu(h), C.value(link)
        if not 0 <= n < len(gpu.spec.nvlinks):
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED if n < N.NVML_NVLINK_MAX_LINKS else N.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.spec.nvlinks[n]

    def nvmlDeviceGetNvLinkState(self, h: Any, link: Any, ref: Any) -> None:
        self._link(h, link)
        C.put(ref, N.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkVersion(self, h: Any, link: Any, ref: Any) -> None:
        self._link(h, link)
        C.put(ref, 4 if self._gpu(h).product.architecture >= 9 else 3)

    def nvmlDeviceGetNvLinkCapability(self, h: Any, link: Any, capability: Any, ref: Any) -> None:
        self._link(h, link)
        if not 0 <= C.value(capability) < N.NVML_NVLINK_CAP_COUNT:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        C.put(ref, 1)

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, h: Any, link: Any, ref: Any) -> None:
        remote = self._link(h, link)
        _fill_pci(C.target(ref), remote.remote_bus_id, remote.remote_pci_device_id)

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: Any, link: Any, ref: Any) -> None:
        C.put(ref, self._link(h, link).remote_type)

    # --- fabric ---------------------------------------------------------------------------------------

    def _fabric(self, h: Any, info: Any) -> None:
        gpu = self._gpu(h)
        fabric = gpu.fabric or fabric_of(self.machine)
        if fabric is None:
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)
        info.clusterUuid[:] = list(fabric.cluster_uuid)
        degraded = (fabric.health_mask >> N.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW) & 0b11 == (
            N.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
        )
        summary = (
            N.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY if degraded else N.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
        )
        C.fill(
            info,
            status=fabric.status,
            cliqueId=fabric.clique_id,
            state=fabric.state,
            healthMask=fabric.health_mask,
            healthSummary=summary,
        )

    def nvmlDeviceGetGpuFabricInfo(self, h: Any, ref: Any) -> None:
        self._fabric(h, C.target(ref))

    def nvmlDeviceGetGpuFabricInfoV(self, h: Any, ref: Any) -> None:
        info = C.target(ref)
        C.check_version(info, N.nvmlGpuFabricInfo_v2, N.nvmlGpuFabricInfo_v3)
        self._fabric(h, info)

    # --- MIG mode and GI profiles ---------------------------------------------------------------------

    def nvmlDeviceGetMigMode(self, h: Any, current: Any, pending: Any) -> None:
        gpu = self._gpu(h)
        gpu.require_mig_capable()
        C.put(current, gpu.mig_current)
        C.put(pending, gpu.mig_pending)

    def nvmlDeviceSetMigMode(self, h: Any, mode: Any, activation: Any) -> None:
        C.put(activation, self._gpu(h).set_mig_mode(C.value(mode)))

    def _profile_info(self, info: Any, gpu: FakeGpu, enum: int) -> None:
        p = gpu.profile_by_enum(enum)
        C.fill(
            info,
            id=p.id,
            isP2pSupported=0,
            sliceCount=p.compute_slices,
            instanceCount=p.max_instances,
            multiprocessorCount=p.multiprocessors,
            copyEngineCount=p.copy_engines,
            decoderCount=p.decoders,
            encoderCount=p.encoders,
            jpegCount=p.jpeg,
            ofaCount=p.ofa,
            memorySizeMB=p.memory_mib,
            name=f"MIG {p.name}".encode(),
        )

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: Any, enum: Any, ref: Any) -> None:
        self._profile_info(C.target(ref), self._gpu(h), C.value(enum))

    def nvmlDeviceGetGpuInstanceProfileInfoV(self, h: Any, enum: Any, ref: Any) -> None:
        info = C.target(ref)
        C.check_version(info, N.nvmlGpuInstanceProfileInfo_v2)
        self._profile_info(info, self._gpu(h), C.value(enum))

    def nvmlDeviceGetGpuInstanceProfileInfoByIdV(self, h: Any, profile_id: Any, ref: Any) -> None:
        info, gpu = C.target(ref), self._gpu(h)
        C.check_version(info, N.nvmlGpuInstanceProfileInfo_v2)
        self._profile_info(info, gpu, gpu.profile_by_id(C.value(profile_id)).enum)

    def nvmlDeviceGetGpuInstancePossiblePlacements_v2(self, h: Any, profile_id: Any, out: Any, count_ref: Any) -> None:
        placements = self._gpu(h).profile_by_id(C.value(profile_id)).placements
        count = C.target(count_ref)
        if out is None:  # size query
            count.value = len(placements)
            return
        if count.value < len(placements):
            count.value = len(placements)
            raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_SIZE)
        array = C.target(out)
        for i, (start, size) in enumerate(placements):
            array[i].start, array[i].size = start, size
        count.value = len(placements)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h: Any, profile_id: Any, ref: Any) -> None:
        C.put(ref, self._gpu(h).remaining_capacity(C.value(profile_id)))

    # --- GPU instances --------------------------------------------------------------------------------

    def nvmlDeviceCreateGpuInstance(self, h: Any, profile_id: Any, ref: Any) -> None:
        gi = self._gpu(h).create_gpu_instance(C.value(profile_id))
        C.put_handle(ref, self.handles.of("gi", gi))

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h: Any, profile_id: Any, placement: Any, ref: Any) -> None:
        gpu, where = self._gpu(h), C.target(placement)
        profile = gpu.profile_by_id(C.value(profile_id))
        if where.size != profile.memory_slices:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        gi = gpu.create_gpu_instance(profile.id, where.start)
        C.put_handle(ref, self.handles.of("gi", gi))

    def nvmlGpuInstanceDestroy(self, gi_handle: Any) -> None:
        gi = self._gi(gi_handle)
        gi.gpu.destroy_gpu_instance(gi)
        self.handles.forget("gi", gi)

    def nvmlDeviceGetGpuInstances(self, h: Any, profile_id: Any, out: Any, count_ref: Any) -> None:
        gpu = self._gpu(h)
        gpu.require_mig_enabled()
        profile = gpu.profile_by_id(C.value(profile_id))
        gis = sorted((gi for gi in gpu.gpu_instances.values() if gi.profile.id == profile.id), key=lambda g: g.id)
        self._put_handles(out, count_ref, "gi", gis)

    def nvmlDeviceGetGpuInstanceById(self, h: Any, gi_id: Any, ref: Any) -> None:
        gpu = self._gpu(h)
        gpu.require_mig_enabled()
        gi = gpu.gpu_instances.get(C.value(gi_id))
        if gi is None:
            raise NvmlFail(N.NVML_ERROR_NOT_FOUND)
        C.put_handle(ref, self.handles.of("gi", gi))

    def nvmlGpuInstanceGetInfo(self, gi_handle: Any, ref: Any) -> None:
        gi, info = self._gi(gi_handle), C.target(ref)
        C.put_field_handle(info, "device", self.handles.of("gpu", gi.gpu))
        info.id, info.profileId = gi.id, gi.profile.id
        info.placement.start, info.placement.size = gi.start, gi.size

    # --- compute instances ----------------------------------------------------------------------------

    def _ci_profile_info(self, gi_handle: Any, enum: Any, engine: Any, info: Any) -> None:
        gi = self._gi(gi_handle)
        if C.value(engine) != N.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        p = gi.ci_profile(C.value(enum))
        C.fill(
            info,
            id=p.enum,
            sliceCount=p.slices,
            instanceCount=p.instance_count,
            multiprocessorCount=p.multiprocessors,
            name=f"MIG {p.name}".encode(),
            **_shared_engines(gi.profile),
        )

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: Any, enum: Any, engine: Any, ref: Any) -> None:
        self._ci_profile_info(gi, enum, engine, C.target(ref))

    def nvmlGpuInstanceGetComputeInstanceProfileInfoV(self, gi: Any, enum: Any, engine: Any, ref: Any) -> None:
        info = C.target(ref)
        C.check_version(info, N.nvmlComputeInstanceProfileInfo_v2)
        self._ci_profile_info(gi, enum, engine, info)

    def nvmlGpuInstanceGetComputeInstanceRemainingCapacity(self, gi: Any, profile_id: Any, ref: Any) -> None:
        C.put(ref, self._gi(gi).remaining_ci_capacity(C.value(profile_id)))

    def nvmlGpuInstanceGetComputeInstancePossiblePlacements(
        self, gi: Any, profile_id: Any, out: Any, count_ref: Any
    ) -> None:
        profile = self._gi(gi).ci_profile(C.value(profile_id))
        starts, count = profile.placements(), C.target(count_ref)
        if out is not None:
            if C.array_capacity(out) < len(starts):
                raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_SIZE)
            array = C.target(out)
            for i, s in enumerate(starts):
                array[i].start, array[i].size = s, profile.slices
        count.value = len(starts)

    def nvmlGpuInstanceCreateComputeInstance(self, gi: Any, profile_id: Any, ref: Any) -> None:
        ci = self._gi(gi).create_compute_instance(C.value(profile_id))
        C.put_handle(ref, self.handles.of("ci", ci))

    def nvmlGpuInstanceCreateComputeInstanceWithPlacement(
        self, gi: Any, profile_id: Any, placement: Any, ref: Any
    ) -> None:
        where = C.target(placement)
        ci = self._gi(gi).create_compute_instance(C.value(profile_id), where.start)
        C.put_handle(ref, self.handles.of("ci", ci))

    def nvmlComputeInstanceDestroy(self, ci_handle: Any) -> None:
        ci = self._ci(ci_handle)
        ci.gpu_instance.destroy_compute_instance(ci)
        self.handles.forget("ci", ci)
        mig = self._mig_devices.pop(id(ci), None)
        if mig is not None:
            self.handles.forget("mig", mig)

    def nvmlGpuInstanceGetComputeInstances(self, gi_handle: Any, profile_id: Any, out: Any, count_ref: Any) -> None:
        gi = self._gi(gi_handle)
        profile = gi.ci_profile(C.value(profile_id))
        cis = sorted((c for c in gi.compute_instances.values() if c.profile.enum == profile.enum), key=lambda c: c.id)
        self._put_handles(out, count_ref, "ci", cis)

    def nvmlGpuInstanceGetComputeInstanceById(self, gi_handle: Any, ci_id: Any, ref: Any) -> None:
        ci = self._gi(gi_handle).compute_instances.get(C.value(ci_id))
        if ci is None:
            raise NvmlFail(N.NVML_ERROR_NOT_FOUND)
        C.put_handle(ref, self.handles.of("ci", ci))

    def nvmlComputeInstanceGetInfo_v2(self, ci_handle: Any, ref: Any) -> None:
        ci, info = self._ci(ci_handle), C.target(ref)
        # `device` is the MIG device handle: NVIDIA's DRA driver reads the MIG uuid through it.
        C.put_field_handle(info, "device", self._mig_handle(ci))
        C.put_field_handle(info, "gpuInstance", self.handles.of("gi", ci.gpu_instance))
        info.id, info.profileId = ci.id, ci.profile.enum
        info.placement.start, info.placement.size = ci.start, ci.profile.slices

    # --- MIG device handles ---------------------------------------------------------------------------

    def nvmlDeviceIsMigDeviceHandle(self, h: Any, ref: Any) -> None:
        C.put(ref, int(isinstance(self._device(h), MigDevice)))

    def nvmlDeviceGetMaxMigDeviceCount(self, h: Any, ref: Any) -> None:
        gpu = self._gpu(h)
        gpu.require_mig_capable()
        C.put(ref, MAX_MIG_DEVICES if gpu.mig_current else 0)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: Any, index: Any, ref: Any) -> None:
        gpu, i = self._gpu(h), C.value(index)
        gpu.require_mig_capable()
        if not gpu.mig_current or not 0 <= i < MAX_MIG_DEVICES:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        ci = next((c for c in gpu.mig_devices() if c.mig_index == i), None)
        if ci is None:
            raise NvmlFail(N.NVML_ERROR_NOT_FOUND)
        C.put_handle(ref, self._mig_handle(ci))

    def _mig(self, h: Any) -> MigDevice:
        dev = self._device(h)
        if not isinstance(dev, MigDevice):
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)
        return dev

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: Any, ref: Any) -> None:
        dev = self._device(h)
        if not isinstance(dev, MigDevice):
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        C.put_handle(ref, self.handles.of("gpu", dev.ci.gpu))

    def nvmlDeviceGetGpuInstanceId(self, h: Any, ref: Any) -> None:
        C.put(ref, self._mig(h).ci.gpu_instance.id)

    def nvmlDeviceGetComputeInstanceId(self, h: Any, ref: Any) -> None:
        C.put(ref, self._mig(h).ci.id)

    def nvmlDeviceGetAttributes_v2(self, h: Any, ref: Any) -> None:
        ci = self._mig(h).ci
        g = ci.gpu_instance.profile
        C.fill(
            C.target(ref),
            multiprocessorCount=ci.profile.multiprocessors,
            gpuInstanceSliceCount=g.compute_slices,
            computeInstanceSliceCount=ci.profile.slices,
            memorySizeMB=g.memory_mib,
            **_shared_engines(g),
        )

    # --- events ---------------------------------------------------------------------------------------

    def _event_set(self, handle: Any) -> EventSet:
        kind, obj = self.handles.resolve(handle)
        if kind != "events" or obj not in self.event_sets:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        assert isinstance(obj, EventSet)
        return obj

    def nvmlEventSetCreate(self, ref: Any) -> None:
        es = EventSet()
        self.event_sets.append(es)
        C.put_handle(ref, self.handles.of("events", es))

    def nvmlDeviceGetSupportedEventTypes(self, h: Any, ref: Any) -> None:
        self._gpu(h)
        C.put(ref, SUPPORTED_EVENTS)

    def nvmlDeviceRegisterEvents(self, h: Any, mask: Any, es_handle: Any) -> None:
        gpu, es, bits = self._gpu(h), self._event_set(es_handle), C.value(mask)
        if bits & ~SUPPORTED_EVENTS:
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)
        es.registered[gpu.index] = es.registered.get(gpu.index, 0) | bits

    def nvmlEventSetWait_v2(self, es_handle: Any, ref: Any, timeout_ms: Any) -> None:
        with self.lock:
            es = self._event_set(es_handle)
        deadline = time.monotonic() + C.value(timeout_ms) / 1000
        while True:
            self._take_pending()
            with es.ready:
                left = deadline - time.monotonic()
                poll = left if self.state is None else min(left, STATE_POLL_S)
                if es.ready.wait_for(lambda: bool(es.queue), timeout=max(poll, 0)):
                    index, event_type, data, gi_id, ci_id = es.queue.popleft()
                    break
            if left <= 0:
                raise NvmlFail(N.NVML_ERROR_TIMEOUT)
        info = C.target(ref)
        C.put_field_handle(info, "device", self.handles.of("gpu", self.gpus[index]))
        C.fill(info, eventType=event_type, eventData=data, gpuInstanceId=gi_id, computeInstanceId=ci_id)

    def nvmlEventSetFree(self, es_handle: Any) -> None:
        es = self._event_set(es_handle)
        self.event_sets.remove(es)
        self.handles.forget("events", es)

    def _take_pending(self) -> None:
        """Move events other processes queued in the state file to this process's sets that listen for them."""
        if self.state is None:
            return
        with self.lock:
            self.refresh()
            if not any(self._listeners(e[0], e[1]) for e in self.pending):
                return
            with self.mutation():
                kept = []
                for event in self.pending:
                    if not self._deliver_here(*event):
                        kept.append(event)
                self.pending = kept

    def _listeners(self, index: int, event_type: int) -> list[EventSet]:
        return [es for es in self.event_sets if es.registered.get(index, 0) & event_type]

    def deliver(
        self, index: int, event_type: int, data: int, gi_id: int = ALL_INSTANCES, ci_id: int = ALL_INSTANCES
    ) -> int:
        """Queue an event on every set registered for it on that GPU; returns how many sets got it.

        With a state file and no listener in this process, the event waits in the file for the process
        that registers for it (the agent), as an Xid stays in the driver until someone reads it. Call
        inside `mutation()`."""
        delivered = self._deliver_here(index, event_type, data, gi_id, ci_id)
        if not delivered and self.state is not None:
            self.pending.append((index, event_type, data, gi_id, ci_id))
        return delivered

    def _deliver_here(
        self, index: int, event_type: int, data: int, gi_id: int = ALL_INSTANCES, ci_id: int = ALL_INSTANCES
    ) -> int:
        delivered = 0
        for es in list(self.event_sets):
            if es.registered.get(index, 0) & event_type:
                with es.ready:
                    es.queue.append((index, event_type, data, gi_id, ci_id))
                    es.ready.notify_all()
                delivered += 1
        return delivered


def _pid_alive(pid: int) -> bool:
    """Whether the process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _shared_engines(gi_profile: Profile) -> dict[str, int]:
    """The engines of a GPU instance, which its compute instances share, in the shared*Count fields."""
    return {
        "sharedCopyEngineCount": gi_profile.copy_engines,
        "sharedDecoderCount": gi_profile.decoders,
        "sharedEncoderCount": gi_profile.encoders,
        "sharedJpegCount": gi_profile.jpeg,
        "sharedOfaCount": gi_profile.ofa,
    }


def _parse_bus_id(text: str) -> tuple[int, int, int, int]:
    """'00000000:18:00.0', '0000:18:00.0' or '18:00.0' -> (domain, bus, device, function)."""
    try:
        parts = text.strip().split(":")
        dev, func = parts[-1].split(".")
        domain = int(parts[-3], 16) if len(parts) == 3 else 0
        return domain, int(parts[-2], 16), int(dev, 16), int(func, 16)
    except (ValueError, IndexError):
        raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT) from None


def _fill_pci(info: Any, bus_id: str, pci_device_id: int) -> None:
    domain, bus, device, _ = _parse_bus_id(bus_id)
    C.fill(
        info,
        busIdLegacy=f"{domain:04X}:{bus:02X}:{device:02X}.0".encode(),
        domain=domain,
        bus=bus,
        device=device,
        pciDeviceId=pci_device_id,
        pciSubSystemId=0x16C110DE if pci_device_id else 0,
        busId=f"{domain:08X}:{bus:02X}:{device:02X}.0".encode(),
    )


def fabric_of(machine: Machine) -> FabricState | None:
    """The fabric registration a machine profile starts with (None: no multi-node NVLink)."""
    f = machine.fabric
    return None if f is None else FabricState(f.cluster_uuid, f.clique_id, f.state, f.status)
