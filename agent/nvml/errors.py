"""The project's NVML error types, and the one place pynvml's NVMLError classes are translated into them.

Callers outside agent.nvml never see pynvml: they catch these classes, which say what went wrong in the
agent's terms (no library, GPU lost, feature missing) and keep NVML's numeric code for logs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pynvml

T = TypeVar("T")


class NvmlError(Exception):
    """An NVML call failed. `code` is NVML's nvmlReturn_t value."""

    def __init__(self, message: str, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        super().__init__(message)
        self.code = code


class NvmlUnavailable(NvmlError):
    """NVML cannot be used on this machine: no library, no driver, or library and driver disagree."""


class GpuLost(NvmlError):
    """The GPU fell off the bus or needs a reset; it cannot be used until then."""


class NotSupported(NvmlError):
    """The GPU or driver does not offer this feature (e.g. MIG on a non-MIG GPU)."""


class FunctionMissing(NotSupported):
    """The installed driver's NVML is older than the function called."""


class NotFound(NvmlError):
    """The object asked for (instance, handle, index) does not exist."""


class InvalidArgument(NvmlError):
    """NVML rejected an argument (an index past the end, a profile the GPU lacks)."""


class InsufficientResources(NvmlError):
    """No room: the MIG placement overlaps existing instances or the profile's limit is reached."""


class InUse(NvmlError):
    """The object is busy (compute instances or processes still exist, GPU not idle)."""


class ResetRequired(NvmlError):
    """The change takes effect only after a GPU reset."""


class NoPermission(NvmlError):
    """The caller lacks the privilege NVML requires (usually root for MIG changes)."""


class Timeout(NvmlError):
    """A wait (for events) ended without result."""


_BY_CODE: dict[int, type[NvmlError]] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: NvmlUnavailable,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: NvmlUnavailable,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: NvmlUnavailable,
    pynvml.NVML_ERROR_UNINITIALIZED: NvmlUnavailable,
    pynvml.NVML_ERROR_GPU_IS_LOST: GpuLost,
    pynvml.NVML_ERROR_NOT_SUPPORTED: NotSupported,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: FunctionMissing,
    pynvml.NVML_ERROR_NOT_FOUND: NotFound,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: InvalidArgument,
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: InsufficientResources,
    pynvml.NVML_ERROR_IN_USE: InUse,
    pynvml.NVML_ERROR_RESET_REQUIRED: ResetRequired,
    pynvml.NVML_ERROR_NO_PERMISSION: NoPermission,
    pynvml.NVML_ERROR_TIMEOUT: Timeout,
}

_EXPLAINED: dict[int, str] = {
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: "the NVML library (libnvidia-ml.so.1) was not found: "
    "is the NVIDIA driver installed and visible to this process?",
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: "the NVIDIA kernel driver is not loaded",
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: "the NVML library and the loaded NVIDIA kernel driver "
    "have different versions (reload the driver or reboot)",
}


def _describe(code: int, exc: pynvml.NVMLError) -> str:
    try:
        return str(exc)
    except Exception:  # str() calls into the library, which may be the thing that is broken
        return f"NVML error {code}"


def translate(exc: pynvml.NVMLError, doing: str = "") -> NvmlError:
    """The project error for a pynvml error; `doing` names the call for the message."""
    code = int(exc.value)
    detail = _EXPLAINED.get(code) or _describe(code, exc)
    message = f"{doing}: {detail}" if doing else detail
    return _BY_CODE.get(code, NvmlError)(message, code)


@contextmanager
def nvml_errors(doing: str = "") -> Iterator[None]:
    """Raise pynvml errors from the block as the project's NvmlError subclasses."""
    try:
        yield
    except pynvml.NVMLError as exc:
        raise translate(exc, doing) from exc


def call(doing: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, its pynvml errors raised as the project's; `doing` names the call for the message."""
    with nvml_errors(doing):
        return fn(*args)
