"""NVML's process-wide init/shutdown as a context manager."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pynvml

from agent.nvml.errors import nvml_errors, translate

log = logging.getLogger(__name__)


@contextmanager
def nvml_session() -> Iterator[None]:
    """Initialise NVML for the block; NVML counts inits, so nested sessions are fine."""
    with nvml_errors("initialising NVML"):
        pynvml.nvmlInit()
    try:
        yield
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:  # nothing left to do about it; keep the block's own outcome
            log.warning("%s", translate(exc, "shutting NVML down"))
