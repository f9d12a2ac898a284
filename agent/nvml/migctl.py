"""Creating and destroying single MIG devices through NVML, for claims allocated a MIG placement.

A MIG device is a GPU instance (GI) at a placement plus one compute instance (CI) spanning the whole GI.
`create` makes both or neither; `destroy` removes the CI, then the GI. GPUs are named by minor or uuid.
Errors are agent.nvml.errors types, with messages that say which device and why.
"""

from __future__ import annotations

import logging
from ctypes import byref, c_uint
from dataclasses import dataclass
from typing import Any

import pynvml

from agent.nvml.errors import (
    InsufficientResources,
    InUse,
    InvalidArgument,
    NotFound,
    NotSupported,
    NvmlError,
    ResetRequired,
    call,
)

log = logging.getLogger(__name__)

GpuRef = int | str  # a GPU's minor number, or its "GPU-..." uuid


@dataclass(frozen=True)
class CreatedMig:
    """A MIG device that `create` made."""

    gpu_instance_id: int
    compute_instance_id: int
    uuid: str  # "MIG-..."


class MigCreateFailed(NvmlError):
    """Creating failed and cleaning up after it failed too: part of the device may remain at its placement."""

    left_behind = True


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class MigControl:
    """MIG device creation and destruction on the GPUs of an initialised NVML session."""

    def create(self, parent: GpuRef, gi_profile_id: int, start: int) -> CreatedMig:
        """A GI of profile `gi_profile_id` at memory slice `start`, with a full-size CI, on GPU `parent`.

        Raises InsufficientResources when the placement (or the profile's instance limit) is taken,
        NotSupported when MIG mode is off; nothing is left behind unless MigCreateFailed says so.
        """
        what = f"MIG profile {gi_profile_id} at placement {start} on GPU {parent}"
        h = self._gpu(parent)
        profile = call(f"reading {what}", pynvml.nvmlDeviceGetGpuInstanceProfileInfoById, h, gi_profile_id)
        memory_slices = self._memory_slices(h, gi_profile_id, start, what)
        placement = pynvml.c_nvmlGpuInstancePlacement_t(start, memory_slices)
        try:
            gi = call(
                f"creating the GPU instance of {what}",
                pynvml.nvmlDeviceCreateGpuInstanceWithPlacement,
                h,
                gi_profile_id,
                byref(placement),
            )
        except InsufficientResources as exc:
            raise InsufficientResources(f"{exc}: placement taken or profile limit reached", exc.code) from exc
        gi_id = int(call(f"reading the GPU instance of {what}", pynvml.nvmlGpuInstanceGetInfo, gi).id)
        ci = None
        try:
            ci_profile = self._full_ci_profile(gi, int(profile.sliceCount), what)
            ci = call(
                f"creating the compute instance of {what}", pynvml.nvmlGpuInstanceCreateComputeInstance, gi, ci_profile
            )
            info = call(f"reading the compute instance of {what}", pynvml.nvmlComputeInstanceGetInfo, ci)
            uuid = _text(call(f"reading the uuid of {what}", pynvml.nvmlDeviceGetUUID, info.device))
            return CreatedMig(gi_id, int(info.id), uuid)
        except NvmlError as exc:
            self._undo(gi, ci, what, exc)
            raise

    def destroy(self, parent: GpuRef, gpu_instance_id: int, compute_instance_id: int | None) -> None:
        """Remove the CI, then the GI. Instances already gone count as destroyed; InUse (processes or other
        CIs still there) is raised and leaves the rest in place."""
        what = f"GPU instance {gpu_instance_id} on GPU {parent}"
        h = self._gpu(parent)
        try:
            gi = call(f"finding {what}", pynvml.nvmlDeviceGetGpuInstanceById, h, gpu_instance_id)
        except (NotFound, InvalidArgument):
            return  # already gone
        except NotSupported:
            return  # MIG mode is off: no GPU instance can exist
        if compute_instance_id is not None:
            try:
                ci = call(
                    f"finding compute instance {compute_instance_id} of {what}",
                    pynvml.nvmlGpuInstanceGetComputeInstanceById,
                    gi,
                    compute_instance_id,
                )
            except (NotFound, InvalidArgument):
                ci = None
            if ci is not None:
                call(
                    f"destroying compute instance {compute_instance_id} of {what}",
                    pynvml.nvmlComputeInstanceDestroy,
                    ci,
                )
        call(f"destroying {what}", pynvml.nvmlGpuInstanceDestroy, gi)

    def find(self, parent: GpuRef, gi_profile_id: int, start: int) -> tuple[int, tuple[int, ...]] | None:
        """(GI id, its CI ids) of the GI of this profile at placement `start`, if one exists: how a crash
        between creating a device and recording its ids is repaired."""
        what = f"MIG profile {gi_profile_id} instances on GPU {parent}"
        h = self._gpu(parent)
        for gi in self._gpu_instances(h, gi_profile_id, what):
            info = call(f"reading {what}", pynvml.nvmlGpuInstanceGetInfo, gi)
            if int(info.placement.start) == start:
                return int(info.id), self._compute_instance_ids(gi, what)
        return None

    def destroy_at(self, parent: GpuRef, gi_profile_id: int, start: int) -> bool:
        """Destroy the GI of this profile at `start` with all its CIs; False when there is none."""
        found = self.find(parent, gi_profile_id, start)
        if found is None:
            return False
        gi_id, ci_ids = found
        for ci_id in ci_ids[1:]:
            self.destroy_compute_instance(parent, gi_id, ci_id)
        self.destroy(parent, gi_id, ci_ids[0] if ci_ids else None)
        return True

    def destroy_compute_instance(self, parent: GpuRef, gpu_instance_id: int, compute_instance_id: int) -> None:
        what = f"compute instance {compute_instance_id} of GPU instance {gpu_instance_id} on GPU {parent}"
        gi = call(f"finding {what}", pynvml.nvmlDeviceGetGpuInstanceById, self._gpu(parent), gpu_instance_id)
        ci = call(f"finding {what}", pynvml.nvmlGpuInstanceGetComputeInstanceById, gi, compute_instance_id)
        call(f"destroying {what}", pynvml.nvmlComputeInstanceDestroy, ci)

    def switch_mig_mode(self, parent: GpuRef, enabled: bool) -> None:
        """Turn MIG mode on or off now. Where the change would wait for a GPU reset (Ampere) or for the GPU's
        processes to end, the pending mode is set back and ResetRequired / InUse raised: nothing changes."""
        what = f"turning MIG mode {'on' if enabled else 'off'} on GPU {parent}"
        h = self._gpu(parent)
        wanted = pynvml.NVML_DEVICE_MIG_ENABLE if enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        status = int(call(what, pynvml.nvmlDeviceSetMigMode, h, wanted))
        if status == pynvml.NVML_SUCCESS:
            return
        current = pynvml.NVML_DEVICE_MIG_DISABLE if enabled else pynvml.NVML_DEVICE_MIG_ENABLE
        call(f"setting back the MIG mode of GPU {parent}", pynvml.nvmlDeviceSetMigMode, h, current)
        if status == pynvml.NVML_ERROR_RESET_REQUIRED:
            raise ResetRequired(f"{what}: the GPU needs a reset for that", status)
        raise InUse(f"{what}: the GPU is in use (NVML activation status {status})", status)

    # --- internals -------------------------------------------------------------------------------------

    def _gpu(self, parent: GpuRef) -> Any:
        if isinstance(parent, str):
            return call(f"finding GPU {parent}", pynvml.nvmlDeviceGetHandleByUUID, parent)
        for index in range(call("counting GPUs", pynvml.nvmlDeviceGetCount)):
            h = call(f"finding GPU {index}", pynvml.nvmlDeviceGetHandleByIndex, index)
            if call(f"reading the minor of GPU {index}", pynvml.nvmlDeviceGetMinorNumber, h) == parent:
                return h
        raise NotFound(f"no GPU with minor number {parent}", pynvml.NVML_ERROR_NOT_FOUND)

    @staticmethod
    def _memory_slices(h: Any, gi_profile_id: int, start: int, what: str) -> int:
        """The placement's size, from the profile's possible placements; a start that is not one is refused."""
        doing = f"reading the placements of {what}"
        count = c_uint(0)
        call(doing, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, gi_profile_id, None, byref(count))
        buffer = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
        call(doing, pynvml.nvmlDeviceGetGpuInstancePossiblePlacements, h, gi_profile_id, buffer, byref(count))
        for p in buffer[: count.value]:
            if int(p.start) == start:
                return int(p.size)
        starts = sorted(int(p.start) for p in buffer[: count.value])
        raise InvalidArgument(
            f"{what}: {start} is not a placement of the profile (starts: {starts})", pynvml.NVML_ERROR_INVALID_ARGUMENT
        )

    @staticmethod
    def _full_ci_profile(gi: Any, compute_slices: int, what: str) -> int:
        """The CI profile spanning the whole GI: the first enum whose slice count is the GI's."""
        for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = call(
                    f"reading compute instance profile {enum} of {what}",
                    pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi,
                    enum,
                    pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
            except (NotSupported, InvalidArgument):
                continue
            if int(info.sliceCount) == compute_slices:
                return int(info.id)
        raise NotSupported(
            f"{what}: no compute instance profile spans {compute_slices} slices", pynvml.NVML_ERROR_NOT_SUPPORTED
        )

    @staticmethod
    def _gpu_instances(h: Any, gi_profile_id: int, what: str) -> list[Any]:
        count = c_uint(0)
        try:
            info = call(f"reading {what}", pynvml.nvmlDeviceGetGpuInstanceProfileInfoById, h, gi_profile_id)
            buffer = (pynvml.c_nvmlGpuInstance_t * max(int(info.instanceCount), 1))()
            call(f"listing {what}", pynvml.nvmlDeviceGetGpuInstances, h, gi_profile_id, buffer, byref(count))
        except NotSupported:
            return []  # MIG mode off: no instances
        return list(buffer[: count.value])

    @staticmethod
    def _compute_instance_ids(gi: Any, what: str) -> tuple[int, ...]:
        ids = []
        for enum in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            count = c_uint(0)
            try:
                info = call(
                    f"reading {what}",
                    pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
                    gi,
                    enum,
                    pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
                )
                buffer = (pynvml.c_nvmlComputeInstance_t * max(int(info.instanceCount), 1))()
                call(f"listing {what}", pynvml.nvmlGpuInstanceGetComputeInstances, gi, enum, buffer, byref(count))
            except (NotSupported, InvalidArgument):
                continue
            for ci in buffer[: count.value]:
                ids.append(int(call(f"reading {what}", pynvml.nvmlComputeInstanceGetInfo, ci).id))
        return tuple(sorted(ids))

    @staticmethod
    def _undo(gi: Any, ci: Any, what: str, cause: NvmlError) -> None:
        """Destroy what a failed `create` made; if that fails too, say that something is left behind."""
        try:
            if ci is not None:
                call(f"destroying the compute instance of {what}", pynvml.nvmlComputeInstanceDestroy, ci)
            call(f"destroying the GPU instance of {what}", pynvml.nvmlGpuInstanceDestroy, gi)
        except NvmlError as exc:
            log.error("cleaning up after a failed MIG create left instances behind: %s", exc)  # noqa: TRY400
            raise MigCreateFailed(f"{cause}; cleaning up failed too ({exc})", cause.code) from cause
