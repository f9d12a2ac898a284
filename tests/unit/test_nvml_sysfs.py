"""PCIe root and NUMA node from a sysfs tree (a temporary one standing in for /sys)."""

from __future__ import annotations

import pathlib

import pytest

from agent.nvml.discovery import fallback_pcie_root, normalize_bus_id
from agent.nvml.sysfs import HostSysfs


def fake_sysfs(root: pathlib.Path, bus_id: str, numa: str | None) -> None:
    device = root / "devices" / "pci0000:17" / "0000:17:01.0" / bus_id
    device.mkdir(parents=True)
    if numa is not None:
        (device / "numa_node").write_text(numa + "\n")
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / bus_id).symlink_to(device)


def test_pcie_root_and_numa_node_come_from_the_device_path(tmp_path: pathlib.Path) -> None:
    fake_sysfs(tmp_path, "0000:18:00.0", "1")
    sysfs = HostSysfs(str(tmp_path))
    assert sysfs.pcie_root("0000:18:00.0") == "pci0000:17"
    assert sysfs.numa_node("0000:18:00.0") == 1


def test_unknown_devices_and_non_numa_machines_give_none(tmp_path: pathlib.Path) -> None:
    fake_sysfs(tmp_path, "0000:18:00.0", "-1")  # the kernel writes -1 on machines without NUMA
    sysfs = HostSysfs(str(tmp_path))
    assert sysfs.numa_node("0000:18:00.0") is None
    assert sysfs.pcie_root("0000:99:00.0") is None
    assert sysfs.numa_node("0000:99:00.0") is None


def test_bus_ids_are_normalised_to_the_kubernetes_form() -> None:
    assert normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert normalize_bus_id(b"00000009:01:00.0") == "0009:01:00.0"
    assert fallback_pcie_root("0000:1a:00.0") == "pci0000:1a"
    with pytest.raises(ValueError, match="not a PCI bus id"):  # tried: a string without a domain
        normalize_bus_id("garbage")
