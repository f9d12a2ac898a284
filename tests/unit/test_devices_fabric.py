"""Which fabric states break a GPU (agent.devices.fabric): what NVML's GetGpuFabricInfoV reports -> the fault
its device taint and health record carry, and which devices of an inventory it covers."""

from __future__ import annotations

import pathlib

import pynvml as N
import pytest

import fakes.nvml as fake_nvml
from agent.devices.fabric import broken_devices, fabric_fault
from agent.nvml.discovery import discover
from agent.nvml.session import nvml_session
from fakes.nvml.machines import nvl72_node


@pytest.mark.parametrize(
    ("state", "status", "degraded", "fault"),
    [
        (N.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, N.NVML_SUCCESS, False, None),  # H100 PCIe: no fabric, no fault
        (N.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, N.NVML_SUCCESS, True, None),
        (N.NVML_GPU_FABRIC_STATE_NOT_STARTED, N.NVML_SUCCESS, False, "not-started"),
        (N.NVML_GPU_FABRIC_STATE_IN_PROGRESS, N.NVML_SUCCESS, False, "in-progress"),
        (N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_ERROR_UNKNOWN, False, "failed"),
        (N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_SUCCESS, True, "degraded-bandwidth"),
        (N.NVML_GPU_FABRIC_STATE_COMPLETED, N.NVML_SUCCESS, False, None),
    ],
)
def test_the_fault_of_each_fabric_state(state: int, status: int, degraded: bool, fault: str | None) -> None:
    """Tried: every registration state NVML names, a failed status, a degraded bandwidth."""
    assert fabric_fault(state, status, degraded) == fault


def test_discovery_reports_the_fault_of_the_gpu_it_breaks(tmp_path: pathlib.Path) -> None:
    """Tried: on the fake NVL72 node, GPU 1 left IN_PROGRESS by the fabric manager: only gpu-1 is broken, and it
    offers no clique either."""
    state = tmp_path / "gpus.json"
    fake_nvml.FakeNvml(nvl72_node(0), state).set_fabric(1, state=N.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    with fake_nvml.install("gb200-nvl72-node00", state), nvml_session():
        inventory = discover()
    assert [g.fabric_fault for g in inventory.gpus] == [None, "in-progress", None, None]
    assert [g.fabric is None for g in inventory.gpus] == [False, True, False, False]
    assert broken_devices(inventory) == {"gpu-1": "in-progress"}
