"""Installing the fake behind pynvml, and the handle tests use to steer it."""

from __future__ import annotations

import os
import types
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import pynvml as N

from fakes.nvml import persist
from fakes.nvml.library import FakeLibrary, fabric_of
from fakes.nvml.machines import Machine, get_machine
from fakes.nvml.state import ALL_INSTANCES, FakeGpu, Process

XID_FALLEN_OFF_THE_BUS = 79


class FakeNvml:
    """A fake libnvidia-ml installed as `pynvml.nvmlLib`, and the controls to change what it reports."""

    def __init__(self, machine: Machine, state: str | os.PathLike[str] | None = None) -> None:
        self.machine = machine
        self.library = FakeLibrary(machine, None if state is None else persist.StateFile(state))
        self.lib = types.SimpleNamespace(**self.library.symbols())
        self._saved: tuple[Any, int] | None = None

    # --- state for assertions -------------------------------------------------------------------------

    @property
    def gpus(self) -> list[FakeGpu]:
        """The fake GPUs by NVML index: `.uuid`, `.minor`, `.mig_current`, `.gpu_instances`, `.processes`...
        (as of now: with a state file, what other processes did is read first)."""
        with self.library.lock:
            self.library.refresh()
        return self.library.gpus

    @property
    def initialized(self) -> bool:
        return self.library.init_count > 0

    # --- controls -------------------------------------------------------------------------------------

    def inject_xid(
        self, gpu_index: int, xid: int, gpu_instance_id: int = ALL_INSTANCES, compute_instance_id: int = ALL_INSTANCES
    ) -> int:
        """An Xid critical error on a GPU, delivered through nvmlEventSetWait_v2 to every event set
        registered for XidCriticalError on it. Returns how many sets received it."""
        return self.inject_event(gpu_index, N.nvmlEventTypeXidCriticalError, xid, gpu_instance_id, compute_instance_id)

    def inject_event(
        self,
        gpu_index: int,
        event_type: int,
        data: int = 0,
        gpu_instance_id: int = ALL_INSTANCES,
        compute_instance_id: int = ALL_INSTANCES,
    ) -> int:
        self._gpu(gpu_index)
        with self.library.mutation():
            return self.library.deliver(gpu_index, event_type, data, gpu_instance_id, compute_instance_id)

    def lose_gpu(self, gpu_index: int, xid: int | None = XID_FALLEN_OFF_THE_BUS) -> None:
        """The GPU falls off the bus: every call on it (handles, MIG, GI/CI) returns GPU_IS_LOST, including
        getting its handle again. The driver reports Xid 79 first; pass xid=None to skip that event."""
        with self.library.mutation():
            if xid is not None:
                self.inject_xid(gpu_index, xid)
            self._gpu(gpu_index).lost = True

    def set_fabric(
        self,
        gpu_index: int | None = None,
        *,
        state: int | None = None,
        status: int | None = None,
        clique_id: int | None = None,
        degraded: bool | None = None,
    ) -> None:
        """Change what the fabric manager reports for one GPU, or every GPU (None): registration `state`
        (NVML_GPU_FABRIC_STATE_*), `status` (an NVML return code), the `clique_id` (a repartitioned rack), or a
        degraded bandwidth (healthMask DEGRADED_BW). Another process sees it through the state file."""
        with self.library.mutation():
            for gpu in self.library.gpus if gpu_index is None else [self._gpu(gpu_index)]:
                current = gpu.fabric or fabric_of(self.machine)
                if current is None:
                    raise ValueError(f"{self.machine.name} has no multi-node NVLink fabric")
                mask = current.health_mask
                if degraded is not None:
                    shift = N.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW
                    value = (
                        N.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
                        if degraded
                        else N.NVML_GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE
                    )
                    mask = (mask & ~(0b11 << shift)) | (value << shift)
                gpu.fabric = replace(
                    current,
                    state=current.state if state is None else state,
                    status=current.status if status is None else status,
                    clique_id=current.clique_id if clique_id is None else clique_id,
                    health_mask=mask,
                )

    def set_processes(
        self,
        gpu_index: int,
        processes: Iterable[tuple[int, int]],
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
        name: str = "",
        tracked: bool = False,
    ) -> None:
        """Replace the compute processes running on a GPU, or on one of its MIG devices (GI and CI id).
        `tracked` processes leave the GPU by themselves once their pid has exited."""
        with self.library.mutation():
            self._set_processes(gpu_index, processes, gpu_instance_id, compute_instance_id, name, tracked)

    def _set_processes(
        self,
        gpu_index: int,
        processes: Iterable[tuple[int, int]],
        gpu_instance_id: int | None,
        compute_instance_id: int | None,
        name: str,
        tracked: bool,
    ) -> None:
        gpu = self._gpu(gpu_index)
        gi_id = ALL_INSTANCES if gpu_instance_id is None else gpu_instance_id
        ci_id = ALL_INSTANCES if compute_instance_id is None else compute_instance_id
        if gpu_instance_id is not None:
            gi = gpu.gpu_instances.get(gpu_instance_id)
            if gi is None or (compute_instance_id is not None and compute_instance_id not in gi.compute_instances):
                raise ValueError(f"GPU {gpu_index} has no MIG device GI {gpu_instance_id} / CI {compute_instance_id}")
        kept = [p for p in gpu.processes if (p.gpu_instance_id, p.compute_instance_id) != (gi_id, ci_id)]
        gpu.processes = kept + [Process(pid, used, gi_id, ci_id, name, tracked) for pid, used in processes]

    def force_error(self, symbol: str, code: int, count: int = 1) -> None:
        """The next `count` calls of C symbol `symbol` (e.g. "nvmlDeviceGetHandleByIndex_v2") return `code`."""
        self._symbol(symbol)
        self.library.forced[symbol] = [code, count]

    def remove_function(self, symbol: str) -> None:
        """Simulate an older driver without this C symbol: pynvml raises NVMLError_FunctionNotFound."""
        self._symbol(symbol)
        delattr(self.lib, symbol)
        N._nvmlGetFunctionPointer_cache.pop(symbol, None)

    def restore_function(self, symbol: str) -> None:
        setattr(self.lib, symbol, self.library.symbols()[symbol])
        N._nvmlGetFunctionPointer_cache.pop(symbol, None)

    def reset_gpu(self, gpu_index: int) -> None:
        """`nvidia-smi -r -i <gpu>`: applies the pending MIG mode and drops all GPU/compute instances.
        Raises GpuBusy while processes run on it (nvidia-smi refuses too)."""
        with self.library.mutation():
            self._gpu(gpu_index).reset()

    # --- install --------------------------------------------------------------------------------------

    def __enter__(self) -> FakeNvml:
        return self

    def __exit__(self, *exc: object) -> None:
        uninstall()

    def mutation(self) -> Any:
        """A context in which tests may change `gpus` directly; with a state file the change is saved."""
        return self.library.mutation()

    def _gpu(self, index: int) -> FakeGpu:
        gpus = self.library.gpus
        if not 0 <= index < len(gpus):
            raise ValueError(f"{self.machine.name} has GPUs 0..{len(gpus) - 1}, not {index}")
        return gpus[index]

    def _symbol(self, symbol: str) -> None:
        if symbol not in self.library.symbols():
            raise ValueError(f"the fake has no C symbol {symbol!r}")


class _Installed:
    """The fake currently behind pynvml, if any."""

    fake: FakeNvml | None = None


def install(machine: str | Machine, state: str | os.PathLike[str] | None = None) -> FakeNvml:
    """Put a fake of `machine` behind pynvml; the real pynvml wrappers then talk to it.

    `state` (default: the FAKE_NVML_STATE environment variable) names a file that keeps the GPUs' state
    across processes; it is created from the machine profile when absent. Replaces any fake installed
    before. Undo with `uninstall()` or by leaving the returned context manager.
    Raises ValueError for an unknown machine or an unusable state file (persist.StateFileError).
    """
    if state is None:
        state = os.environ.get(persist.ENV) or None
    fake = FakeNvml(get_machine(machine), state)
    previous = _Installed.fake
    fake._saved = previous._saved if previous is not None else (N.nvmlLib, N._nvmlLib_refcount)
    _Installed.fake = fake
    N.nvmlLib = fake.lib
    N._nvmlLib_refcount = 0
    N._nvmlGetFunctionPointer_cache.clear()
    return fake


def uninstall() -> None:
    """Restore what pynvml had before the first install (normally nothing loaded)."""
    fake = _Installed.fake
    if fake is None or fake._saved is None:
        return
    N.nvmlLib, N._nvmlLib_refcount = fake._saved
    N._nvmlGetFunctionPointer_cache.clear()
    _Installed.fake = None


def installed() -> FakeNvml | None:
    return _Installed.fake
