"""The only package that imports pynvml: discovery, sessions and NVML errors in the project's terms."""

from agent.nvml.discovery import discover
from agent.nvml.errors import GpuLost, NotSupported, NvmlError, NvmlUnavailable
from agent.nvml.session import nvml_session
from agent.nvml.source import NvmlSource, open_nvml, parse_nvml_spec

__all__ = [
    "GpuLost",
    "NotSupported",
    "NvmlError",
    "NvmlSource",
    "NvmlUnavailable",
    "discover",
    "nvml_session",
    "open_nvml",
    "parse_nvml_spec",
]
