"""The GB200 NVL72 profile of the NVML fake and its settable fabric, read through the agent's own discovery."""

from __future__ import annotations

import pathlib

import pynvml as N
import pytest

import fakes.nvml as fake_nvml
from agent.nvml.discovery import discover
from agent.nvml.session import nvml_session
from fakes.nvml.machines import NVL72_NODES, nvl72_node


def _discover(machine: str, state: pathlib.Path | None = None):
    with fake_nvml.install(machine, state), nvml_session():
        return discover()


def test_nvl72_rack_is_18_nodes_of_4_gpus_in_one_clique() -> None:
    names = [f"gb200-nvl72-node{i:02d}" for i in range(NVL72_NODES)]
    assert set(names) <= set(fake_nvml.machine_names())
    domains, uuids = set(), set()
    for name in (names[0], names[17]):
        inventory = _discover(name)
        assert [g.product_name for g in inventory.gpus] == ["NVIDIA GB200"] * 4
        assert inventory.gpus[0].architecture == "Blackwell"
        domains |= {g.nvlink_domain for g in inventory.gpus}
        uuids |= {g.uuid for g in inventory.gpus}
    assert len(domains) == 1 and next(iter(domains)).endswith(".1")  # one cluster UUID, clique 1, across nodes
    assert len(uuids) == 8  # every node's GPUs are its own
    assert nvl72_node(3).gpus[0].bus_id == "00000008:01:00.0"


def test_fabric_states_are_settable_and_outlive_the_process(tmp_path: pathlib.Path) -> None:
    state = tmp_path / "gpus.json"
    fake = fake_nvml.FakeNvml(nvl72_node(0), state)
    fake.set_fabric(1, degraded=True)
    fake.set_fabric(2, state=N.NVML_GPU_FABRIC_STATE_IN_PROGRESS)
    fake.set_fabric(3, clique_id=2)
    # another process (here: a fresh fake on the same file) sees what was set
    inventory = _discover(fake_nvml.FakeNvml(nvl72_node(0), state).machine.name, state)
    by_index = {g.index: g for g in inventory.gpus}
    assert by_index[0].fabric is not None and not by_index[0].fabric.degraded
    assert by_index[1].fabric is not None and by_index[1].fabric.degraded  # still in the clique, degraded
    assert by_index[2].fabric is None  # registration not finished: not attached (NVIDIA's IsFabricAttached)
    assert by_index[3].fabric is not None and by_index[3].fabric.clique_id == 2
    fake.set_fabric(None, state=N.NVML_GPU_FABRIC_STATE_COMPLETED, degraded=False, clique_id=1)
    assert all(g.fabric is not None and not g.fabric.degraded for g in _discover("gb200-nvl72-node00", state).gpus)


def test_a_machine_without_fabric_refuses_fabric_settings() -> None:
    with pytest.raises(ValueError, match="no multi-node NVLink fabric"):
        fake_nvml.FakeNvml(fake_nvml.MACHINES["dgx-h100"]).set_fabric(0, degraded=True)
