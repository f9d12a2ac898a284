"""The same assertions against the NVML fake and, where this machine has a GPU, against real NVML.

Everything asserted here must hold on any real node: if the fake and real NVML disagree, one of these
fails on the GPU machine and the fake is what needs fixing.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator

import pytest

from agent.devices.geometry import PlacedProfile, is_valid_layout
from agent.devices.model import Inventory
from agent.devices.names import GpuName, MigName, gpu_device_name, mig_device_name, parse_device_name, profile_token
from agent.nvml.errors import NvmlUnavailable
from agent.nvml.source import open_nvml

BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
VERSION = re.compile(r"^\d+\.\d+$")
PROFILE = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\+me|\+me\.all|\+gfx|-me)?$")
FAKES = ["dgx-a100-40gb", "dgx-h100", "h100-nvl-x4", "gh200", "mixed-mig", "a100-pcie-x2"]


def real_nvml_works() -> bool:
    try:
        with open_nvml("real"):
            return True
    except NvmlUnavailable:
        return False


SOURCES = [pytest.param(f"fake:{m}", id=m) for m in FAKES] + [
    pytest.param(
        "real",
        id="real",
        marks=[
            pytest.mark.real_nvml,
            pytest.mark.skipif(not real_nvml_works(), reason="pynvml.nvmlInit() does not work here"),
        ],
    )
]


@pytest.fixture(params=SOURCES, scope="module")
def inventory(request: pytest.FixtureRequest) -> Iterator[Inventory]:
    with open_nvml(request.param) as nvml:
        yield nvml.discover()


def test_versions_are_reported(inventory: Inventory) -> None:
    assert re.match(r"^\d+\.\d+", inventory.driver_version)
    assert VERSION.match(inventory.cuda_driver_version)


def test_gpus_have_identity(inventory: Inventory) -> None:
    assert inventory.gpus
    assert len({g.uuid for g in inventory.gpus}) == len(inventory.gpus)
    assert len({g.minor for g in inventory.gpus}) == len(inventory.gpus)
    assert sorted(g.index for g in inventory.gpus) == list(range(len(inventory.gpus)))
    for g in inventory.gpus:
        assert g.uuid.startswith("GPU-")
        assert parse_device_name(gpu_device_name(g.minor)) == GpuName(g.minor)
        assert g.product_name and g.brand and g.architecture
        assert VERSION.match(g.cuda_compute_capability)
        assert g.memory_bytes > 2**30
        assert BUS_ID.match(g.pci_bus_id)
        assert g.pci_device_id & 0xFFFF == 0x10DE  # NVIDIA's PCI vendor id
        assert g.numa_node is None or g.numa_node >= 0


def test_mig_profiles_and_placements_are_coherent(inventory: Inventory) -> None:
    for g in inventory.gpus:
        if not g.mig_capable:
            assert not g.mig_enabled and not g.mig_profiles
            continue
        assert len({p.gi_profile_id for p in g.mig_profiles}) == len(g.mig_profiles)
        for p in g.mig_profiles:
            assert PROFILE.match(p.name), p.name
            assert p.compute_slices >= 1 and p.max_instances >= 1 and p.multiprocessors >= 1
            assert p.memory_bytes <= g.memory_bytes
            assert len(set(p.placements)) == len(p.placements)
            for pl in p.placements:
                assert pl.size == p.memory_slices and pl.start >= 0 and pl.start + pl.size <= 8
                name = mig_device_name(g.minor, p.name, p.gi_profile_id, pl.start)
                assert parse_device_name(name) == MigName(g.minor, profile_token(p.name), p.gi_profile_id, pl.start)
            # A lone instance of any profile, at any of its placements, is a valid layout.
            assert all(is_valid_layout([PlacedProfile.of(p, pl)], g.mig_profiles) for pl in p.placements)


def test_existing_mig_devices_fit_their_parent(inventory: Inventory) -> None:
    assert len({m.uuid for m in inventory.mig_devices}) == len(inventory.mig_devices)
    for m in inventory.mig_devices:
        parent = inventory.gpu(m.parent_minor)
        assert parent is not None and parent.uuid == m.parent_uuid and parent.mig_enabled
        assert m.uuid.startswith("MIG-")
        profile = parent.profile(m.gi_profile_id)
        assert profile is not None and profile.name == m.profile
        assert m.placement in profile.placements
        assert 0 < m.memory_bytes <= parent.memory_bytes
    for g in inventory.gpus:
        held = [PlacedProfile.of(g.profile(gi.gi_profile_id), gi.placement) for gi in g.gpu_instances]  # type: ignore[arg-type]
        for a, b in itertools.combinations(held, 2):
            assert not a.placement.overlaps(b.placement)
        assert not g.gpu_instances or g.mig_enabled


def test_nvlink_domains_partition_the_gpus(inventory: Inventory) -> None:
    minors = [m for d in inventory.nvlink_domains for m in d.gpu_minors]
    assert sorted(minors) == sorted(g.minor for g in inventory.gpus)
    for d in inventory.nvlink_domains:
        assert d.id
        assert {inventory.gpu(m).nvlink_domain for m in d.gpu_minors} == {d.id}  # type: ignore[union-attr]
        if d.fabric:
            assert re.match(r"^[0-9a-f-]{36}\.\d+$", d.id)
