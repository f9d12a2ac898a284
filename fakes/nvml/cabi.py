"""The C side of the fake: reading ctypes arguments the way libnvidia-ml would, and writing results back."""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml as N

from fakes.nvml.state import NvmlFail

_VOID_P = ctypes.c_void_p
_CARG = type(ctypes.byref(ctypes.c_int()))


def value(arg: Any) -> int:
    """An integer argument, passed as a Python int or a ctypes scalar."""
    return int(arg.value) if hasattr(arg, "value") else int(arg)


def text(arg: Any) -> str:
    """A `const char *` argument, passed as bytes (or None) or a ctypes string buffer."""
    return (arg.value if hasattr(arg, "value") else arg or b"").decode()


def target(ref: Any) -> Any:
    """What a pointer argument points at: byref(x) -> x, pointer(x) -> x; None is a NULL pointer."""
    if ref is None:
        raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
    if isinstance(ref, _CARG):
        return getattr(ref, "_obj")  # noqa: B009 (CArgObject keeps its referent here)
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    return ref


def address(handle: Any) -> int:
    """The address inside an opaque handle (nvmlDevice_t and friends are pointers)."""
    if handle is None:
        return 0
    if isinstance(handle, int):
        return handle
    if isinstance(handle, _CARG):
        handle = getattr(handle, "_obj")  # noqa: B009
    return ctypes.cast(handle, _VOID_P).value or 0


def put_handle(ref: Any, addr: int) -> None:
    """*ref = handle, for an output parameter of a pointer type."""
    _VOID_P.from_buffer(target(ref)).value = addr


def put_field_handle(struct: Any, name: str, addr: int) -> None:
    _VOID_P.from_buffer(struct, getattr(type(struct), name).offset).value = addr


def put_array_handle(array: Any, index: int, addr: int) -> None:
    _VOID_P.from_buffer(array, index * ctypes.sizeof(_VOID_P)).value = addr


def put(ref: Any, v: int) -> None:
    target(ref).value = v


def put_string(buf: Any, length: Any, text: str) -> None:
    """Copy a NUL-terminated string into a caller buffer of `length` bytes."""
    data = text.encode()
    if buf is None:
        raise NvmlFail(N.NVML_ERROR_INVALID_ARGUMENT)
    if len(data) + 1 > value(length):
        raise NvmlFail(N.NVML_ERROR_INSUFFICIENT_SIZE)
    target(buf).value = data


def fill(struct: Any, **fields: Any) -> None:
    """Set the named fields the caller's struct version has (older versions lack some)."""
    names = {f[0] for f in type(struct)._fields_}
    for k, v in fields.items():
        if k in names:
            setattr(struct, k, v)


def check_version(struct: Any, *accepted: int) -> None:
    if getattr(struct, "version", None) not in accepted:
        raise NvmlFail(N.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)


def array_capacity(array: Any) -> int:
    return len(target(array))
