"""`--nvml real|fake:<machine>`: which NVML the process talks to, opened and closed in one place.

The inventory command and the node daemon both take this flag. A fake machine replaces the library
behind pynvml (fakes.nvml), so everything above it runs the same code as on a real node.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from agent.devices.model import Inventory
from agent.nvml.discovery import discover
from agent.nvml.session import nvml_session
from agent.nvml.sysfs import HostSysfs, PciTopology

REAL = "real"
FAKE_PREFIX = "fake:"


class InvalidNvmlSpec(ValueError):
    """The --nvml value is neither `real` nor `fake:<machine>`."""


@dataclass(frozen=True)
class NvmlSpec:
    machine: str | None  # None: the real library

    @property
    def is_fake(self) -> bool:
        return self.machine is not None

    def __str__(self) -> str:
        return REAL if self.machine is None else FAKE_PREFIX + self.machine


def parse_nvml_spec(spec: str) -> NvmlSpec:
    if spec == REAL:
        return NvmlSpec(None)
    if spec.startswith(FAKE_PREFIX) and spec[len(FAKE_PREFIX) :]:
        return NvmlSpec(spec[len(FAKE_PREFIX) :])
    raise InvalidNvmlSpec(f"--nvml must be 'real' or 'fake:<machine>' (e.g. fake:dgx-h100), not {spec!r}")


@dataclass(frozen=True)
class NvmlSource:
    """An open NVML: discover through it; `fake` is the fake's control handle (None on real NVML)."""

    spec: NvmlSpec
    topology: PciTopology | None
    fake: Any = None

    def discover(self) -> Inventory:
        return discover(self.topology)


def _fake_nvml() -> Any:
    """The NVML fake: part of the test world (the checkout's `fakes`, or the image's test layer), never of the
    product, so a node agent asked for it where it is not installed says so instead of failing on an import."""
    try:
        return importlib.import_module("fakes.nvml")  # only ever loaded when asked for
    except ModuleNotFoundError as exc:
        if exc.name not in ("fakes", "fakes.nvml"):
            raise
        raise InvalidNvmlSpec(
            "--nvml fake:<machine> needs the NVML fake, which is not installed: it belongs to the "
            "tests (a checkout's test venv, or the image's test layer); use --nvml real"
        ) from None


@contextmanager
def open_nvml(spec: str | NvmlSpec) -> Iterator[NvmlSource]:
    """Install the fake if asked, initialise NVML, and undo both on exit."""
    parsed = parse_nvml_spec(spec) if isinstance(spec, str) else spec
    with ExitStack() as stack:
        fake = None
        if parsed.machine is not None:
            fakes_nvml = _fake_nvml()
            try:
                fake = fakes_nvml.install(parsed.machine)
            except ValueError as exc:  # an unknown machine name: the flag is wrong
                raise InvalidNvmlSpec(str(exc)) from exc
            stack.callback(fakes_nvml.uninstall)
        stack.enter_context(nvml_session())
        # A fake GPU's bus id may name an unrelated device in this host's /sys: derive instead.
        yield NvmlSource(parsed, None if parsed.is_fake else HostSysfs(), fake)
