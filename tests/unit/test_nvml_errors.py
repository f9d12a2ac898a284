"""NVML errors reach the rest of the agent as the project's own types, with NVML's code kept."""

from __future__ import annotations

import pynvml
import pytest

from agent.nvml import errors as E


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, E.NvmlUnavailable),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, E.NvmlUnavailable),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, E.NvmlUnavailable),
        (pynvml.NVML_ERROR_GPU_IS_LOST, E.GpuLost),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, E.NotSupported),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, E.FunctionMissing),
        (pynvml.NVML_ERROR_NOT_FOUND, E.NotFound),
        (pynvml.NVML_ERROR_INVALID_ARGUMENT, E.InvalidArgument),
        (pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES, E.InsufficientResources),
        (pynvml.NVML_ERROR_IN_USE, E.InUse),
        (pynvml.NVML_ERROR_RESET_REQUIRED, E.ResetRequired),
        (pynvml.NVML_ERROR_NO_PERMISSION, E.NoPermission),
        (pynvml.NVML_ERROR_TIMEOUT, E.Timeout),
        (pynvml.NVML_ERROR_MEMORY, E.NvmlError),
    ],
)
def test_each_nvml_error_class_maps_to_a_project_error(code: int, kind: type[E.NvmlError]) -> None:
    with pytest.raises(kind) as caught, E.nvml_errors("doing something"):
        raise pynvml.NVMLError(code)
    assert type(caught.value) is kind
    assert caught.value.code == code
    assert str(caught.value).startswith("doing something: ")
    assert isinstance(caught.value.__cause__, pynvml.NVMLError)


def test_a_missing_function_is_also_not_supported() -> None:
    # Callers that degrade on NotSupported also cover drivers that lack the function altogether.
    assert issubclass(E.FunctionMissing, E.NotSupported)


def test_a_missing_library_says_what_to_check() -> None:
    err = E.translate(pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND))
    assert "libnvidia-ml.so.1" in str(err)
    assert "\n" not in str(err)


def test_other_exceptions_pass_through_untouched() -> None:
    with pytest.raises(KeyError), E.nvml_errors():
        raise KeyError("not NVML")
