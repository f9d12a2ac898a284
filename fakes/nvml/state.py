"""Mutable state of the fake GPUs and the MIG rules the real driver enforces.

Failures raise NvmlFail(code) with the NVML return code the real library gives; the C-symbol layer turns
them into return values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pynvml as N

from fakes.nvml.machines import GpuSpec, Machine, deterministic_uuid4
from fakes.nvml.products import Profile

ALL_INSTANCES = 0xFFFFFFFF  # gpuInstanceId/computeInstanceId of a process or event on the whole GPU
COMPUTE_SLICES = 7
TIMESLICE_DEFAULT = 0  # compute-policy time slice: 0 Default, 1 Short, 2 Medium, 3 Long
# Auto-placement (nvmlDeviceCreateGpuInstance) is driver-chosen, not lowest-first. Observed: successive
# 1-slice GIs at 6,4,5,0,1,2,3; a lone 2g at 4; two 3g GIs get ids 2 then 1 (upper half first). The
# driver fills the half that already has the unusable 8th memory slice first; this table encodes that.
_PREFERRED_STARTS = {1: (6, 4, 5, 0, 1, 2, 3), 2: (6, 4, 0, 2), 4: (4, 0), 8: (0,)}
# NVML_COMPUTE_INSTANCE_PROFILE_* enums the fake supports, with their compute-slice counts.
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}


class NvmlFail(Exception):
    """An NVML call fails with this return code."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class GpuBusy(RuntimeError):
    """A reset was asked for while processes still use the GPU (nvidia-smi -r refuses too)."""


def gpu_instance_id(start: int, size: int) -> int:
    """GI ids as the driver assigns them: 1-slice start s -> 7+s, 2-slice -> 3+s/2, 4-slice -> 1+s/4, 8 -> 0."""
    return {1: 7 + start, 2: 3 + start // 2, 4: 1 + start // 4, 8: 0}[size]


@dataclass(eq=False)
class Process:
    pid: int
    used_bytes: int
    gpu_instance_id: int = ALL_INSTANCES
    compute_instance_id: int = ALL_INSTANCES
    name: str = ""  # nvmlSystemGetProcessName; the fake MPS server is "nvidia-cuda-mps-server"
    # A process a fake binary registered for itself: it leaves the GPU when that pid is gone, as the
    # driver drops the contexts of a killed process.
    tracked: bool = False


@dataclass(frozen=True)
class CiProfile:
    """A compute-instance profile inside one GI: `enum` doubles as its info.id, as on real drivers."""

    enum: int
    slices: int
    instance_count: int
    multiprocessors: int
    name: str

    def placements(self) -> list[int]:
        return list(range(0, self.instance_count * self.slices, self.slices))


@dataclass(eq=False)
class ComputeInstance:
    """A CI; together with its GI it is one MIG device."""

    gpu_instance: GpuInstance
    id: int
    profile: CiProfile
    start: int
    uuid: str

    @property
    def gpu(self) -> FakeGpu:
        return self.gpu_instance.gpu

    @property
    def mig_index(self) -> int:
        """Index for GetMigDeviceHandleByIndex: the first slice it sits on, so indexes are sparse as on
        real drivers (a 3g at 4 with a 2g at 0 gives 0 and 4; 1-3 and 5-6 answer NotFound)."""
        return self.gpu_instance.start + self.start

    @property
    def exists(self) -> bool:
        """Still in its GI's table, and that GI still on its GPU (a reset drops both)."""
        return self.gpu_instance.exists and self.gpu_instance.compute_instances.get(self.id) is self

    @property
    def processes(self) -> list[Process]:
        gi = self.gpu_instance.id
        return [p for p in self.gpu.processes if (p.gpu_instance_id, p.compute_instance_id) == (gi, self.id)]


@dataclass(eq=False)
class GpuInstance:
    gpu: FakeGpu
    id: int
    profile: Profile
    start: int
    compute_instances: dict[int, ComputeInstance] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.profile.memory_slices

    @property
    def exists(self) -> bool:
        """Not destroyed (nor dropped by a GPU reset) since it was created."""
        return self.gpu.gpu_instances.get(self.id) is self

    def ci_profile(self, enum: int) -> CiProfile:
        if not 0 <= enum < N.NVML_COMPUTE_INSTANCE_PROFILE_COUNT:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        slices, whole = _CI_SLICES.get(enum), self.profile.compute_slices
        if slices is None or slices > whole:
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)
        name = self.profile.name if slices == whole else f"{slices}c.{self.profile.name}"
        return CiProfile(enum, slices, whole // slices, self.profile.multiprocessors * slices // whole, name)

    def create_compute_instance(self, enum: int, start: int | None = None) -> ComputeInstance:
        profile = self.ci_profile(enum)
        if start is not None and start not in profile.placements():
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        free = self._free_starts(profile)
        if start is None:
            start = free[0] if free else -1
        if start not in free or len(self._used_slices()) + profile.slices > self.profile.compute_slices:
            raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_RESOURCES)
        ci_id = next(i for i in range(len(self.compute_instances) + 1) if i not in self.compute_instances)
        uuid = "MIG-" + str(deterministic_uuid4(f"{self.gpu.uuid}/{self.id}/{ci_id}/{self.gpu.next_serial()}"))
        ci = ComputeInstance(self, ci_id, profile, start, uuid)
        self.compute_instances[ci_id] = ci
        return ci

    def destroy_compute_instance(self, ci: ComputeInstance) -> None:
        if ci.processes:
            raise NvmlFail(N.NVML_ERROR_IN_USE)
        del self.compute_instances[ci.id]

    def remaining_ci_capacity(self, enum: int) -> int:
        profile = self.ci_profile(enum)
        left = self.profile.compute_slices - len(self._used_slices())
        return min(len(self._free_starts(profile)), left // profile.slices)

    def _used_slices(self) -> set[int]:
        return {s for ci in self.compute_instances.values() for s in range(ci.start, ci.start + ci.profile.slices)}

    def _free_starts(self, profile: CiProfile) -> list[int]:
        """The placements of `profile` that no compute instance overlaps."""
        used = self._used_slices()
        return [s for s in profile.placements() if used.isdisjoint(range(s, s + profile.slices))]


@dataclass(frozen=True)
class FabricState:
    """One GPU's multi-node NVLink fabric registration: what the fabric manager reports for it."""

    cluster_uuid: bytes  # 16 bytes; all zero: NVLink-capable but not multi-node
    clique_id: int
    state: int = N.NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = N.NVML_SUCCESS
    health_mask: int = 0  # nvmlGpuFabricInfo healthMask bits (e.g. DEGRADED_BW_TRUE)


class FakeGpu:
    """One physical GPU of the fake machine."""

    def __init__(self, machine: Machine, index: int, spec: GpuSpec) -> None:
        self.index = index
        self.spec = spec
        self.product = spec.product
        self.uuid = machine.gpu_uuid(index)
        self.minor = spec.minor
        self.bus_id = spec.bus_id
        self.mig_current = self.mig_pending = 0
        self.compute_mode = N.NVML_COMPUTEMODE_DEFAULT
        self.timeslice = TIMESLICE_DEFAULT  # `nvidia-smi compute-policy --set-timeslice` (0..3)
        self.lost = False
        # The fabric as GetGpuFabricInfoV reports it; None: the machine profile's (a test can break it mid-job)
        self.fabric: FabricState | None = None
        self.processes: list[Process] = []
        self.gpu_instances: dict[int, GpuInstance] = {}
        self._serial = 0
        if spec.mig_layout is not None:
            self.mig_current = self.mig_pending = 1
            for name in spec.mig_layout:
                profile = next(p for p in self.product.profiles if p.name == name)
                gi = self.create_gpu_instance(profile.id)
                gi.create_compute_instance(_full_ci_enum(profile))

    def next_serial(self) -> int:
        self._serial += 1
        return self._serial

    # --- profiles -------------------------------------------------------------------------------------

    def profile_by_enum(self, enum: int) -> Profile:
        self.require_mig_capable()
        if not 0 <= enum < N.NVML_GPU_INSTANCE_PROFILE_COUNT:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        for p in self.product.profiles:
            if p.enum == enum:
                return p
        raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)

    def profile_by_id(self, profile_id: int) -> Profile:
        """Everything but GetGpuInstanceProfileInfo[V] names a profile by info.id, not by enum."""
        self.require_mig_capable()
        for p in self.product.profiles:
            if p.id == profile_id:
                return p
        raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)

    def require_mig_capable(self) -> None:
        if not self.product.mig_capable:
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)

    def require_mig_enabled(self) -> None:
        self.require_mig_capable()
        if not self.mig_current:
            raise NvmlFail(N.NVML_ERROR_NOT_SUPPORTED)

    # --- GPU instances --------------------------------------------------------------------------------

    def _fits(self, profile: Profile, start: int) -> bool:
        mine = [gi for gi in self.gpu_instances.values() if gi.profile.id == profile.id]
        if len(mine) >= profile.max_instances:
            return False
        compute = sum(gi.profile.compute_slices for gi in self.gpu_instances.values())
        if compute + profile.compute_slices > COMPUTE_SLICES:
            return False
        end = start + profile.memory_slices
        return all(end <= gi.start or gi.start + gi.size <= start for gi in self.gpu_instances.values())

    def _auto_start(self, profile: Profile) -> int | None:
        allowed = {s for s, _ in profile.placements}
        order = [s for s in _PREFERRED_STARTS.get(profile.memory_slices, ()) if s in allowed]
        order += sorted(allowed - set(order))
        return next((s for s in order if self._fits(profile, s)), None)

    def create_gpu_instance(self, profile_id: int, start: int | None = None) -> GpuInstance:
        self.require_mig_enabled()
        profile = self.profile_by_id(profile_id)
        if start is not None and (start, profile.memory_slices) not in profile.placements:
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        if start is None:
            start = self._auto_start(profile)
        if start is None or not self._fits(profile, start):
            raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_RESOURCES)
        gi = GpuInstance(self, gpu_instance_id(start, profile.memory_slices), profile, start)
        self.gpu_instances[gi.id] = gi
        return gi

    def destroy_gpu_instance(self, gi: GpuInstance) -> None:
        if gi.compute_instances or any(p.gpu_instance_id == gi.id for p in self.processes):
            raise NvmlFail(N.NVML_ERROR_IN_USE)
        del self.gpu_instances[gi.id]

    def remaining_capacity(self, profile_id: int) -> int:
        """How many more GIs of this profile auto-placement could create now."""
        self.require_mig_enabled()
        profile = self.profile_by_id(profile_id)
        placed: list[GpuInstance] = []
        try:
            while (start := self._auto_start(profile)) is not None:
                gi = GpuInstance(self, -1 - len(placed), profile, start)
                self.gpu_instances[gi.id] = gi
                placed.append(gi)
        finally:
            for gi in placed:
                del self.gpu_instances[gi.id]
        return len(placed)

    def mig_devices(self) -> list[ComputeInstance]:
        cis = [ci for gi in self.gpu_instances.values() for ci in gi.compute_instances.values()]
        return sorted(cis, key=lambda ci: ci.mig_index)

    # --- MIG mode and reset ---------------------------------------------------------------------------

    def set_mig_mode(self, mode: int) -> int:
        """Returns activationStatus: 0 when the mode took effect now, else why it is still pending."""
        self.require_mig_capable()
        if mode not in (N.NVML_DEVICE_MIG_DISABLE, N.NVML_DEVICE_MIG_ENABLE):
            raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
        if mode == N.NVML_DEVICE_MIG_DISABLE and self.gpu_instances:
            raise NvmlFail(N.NVML_ERROR_IN_USE)
        self.mig_pending = mode
        if mode == self.mig_current:
            return 0
        if not self.product.applies_mig_mode_at_once:
            return int(N.NVML_ERROR_RESET_REQUIRED)  # Ampere: pending until `nvidia-smi -r`
        if self.processes:
            return int(N.NVML_ERROR_IN_USE)
        self.mig_current = mode
        return 0

    def reset(self) -> None:
        """`nvidia-smi -r`: pending MIG mode takes effect; GPU and compute instances do not survive."""
        if self.lost:
            raise GpuBusy(f"GPU {self.index} is lost; a reset cannot reach it")
        if self.processes:
            raise GpuBusy(f"GPU {self.index} is in use by {len(self.processes)} process(es)")
        self.mig_current = self.mig_pending
        self.gpu_instances.clear()


def _full_ci_enum(profile: Profile) -> int:
    return next(e for e, s in _CI_SLICES.items() if s == profile.compute_slices)
