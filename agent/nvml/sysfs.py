"""What Linux sysfs knows about a PCI device that NVML does not say: its PCIe root and NUMA node.

Discovery takes a `PciTopology` so tests and fakes can supply their own (or none) instead of the host's
/sys, where a fake GPU's bus id may name some unrelated real device.
"""

from __future__ import annotations

import os
from typing import Protocol


class PciTopology(Protocol):
    def pcie_root(self, bus_id: str) -> str | None:
        """The root complex the device hangs off, e.g. "pci0000:00"; None when unknown."""
        ...

    def numa_node(self, bus_id: str) -> int | None:
        """The device's NUMA node; None when unknown or the machine is not NUMA."""
        ...


class HostSysfs:
    """Reads /sys/bus/pci/devices/<bus id> on this host."""

    def __init__(self, root: str = "/sys") -> None:
        self._devices = os.path.join(root, "bus", "pci", "devices")

    def pcie_root(self, bus_id: str) -> str | None:
        link = os.path.join(self._devices, bus_id)
        if not os.path.exists(link):
            return None
        # /sys/bus/pci/devices/0000:18:00.0 -> ../../../devices/pci0000:17/0000:17:01.0/.../0000:18:00.0
        parts = os.path.realpath(link).split(os.sep)
        return next((p for p in parts if p.startswith("pci")), None)

    def numa_node(self, bus_id: str) -> int | None:
        try:
            with open(os.path.join(self._devices, bus_id, "numa_node"), encoding="ascii") as f:
                node = int(f.read().strip())
        except (OSError, ValueError):
            return None
        return node if node >= 0 else None
