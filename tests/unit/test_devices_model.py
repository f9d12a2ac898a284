"""The inventory model: lookups, profile resolution, derived values."""

from __future__ import annotations

import dataclasses

import pytest

from agent.devices.model import FabricInfo, Gpu, Inventory, MigDevice, MigPlacement, MigProfile
from tests.factories import h100 as gpu

P3G = MigProfile("3g.40gb", 2, 9, 3, 4, 2, 40448, 60, 3, 3, 0, 3, 0, (MigPlacement(0, 4), MigPlacement(4, 4)))


def mig(parent: Gpu, start: int) -> MigDevice:
    return MigDevice(
        f"MIG-{parent.minor}-{start}",
        parent.uuid,
        parent.minor,
        parent.index,
        "3g.40gb",
        9,
        MigPlacement(start, 4),
        1 + start // 4,
        0,
        40448 * 2**20,
        60,
        3,
        3,
        0,
        3,
        0,
    )


def test_inventory_finds_gpus_by_minor() -> None:
    gpus = (gpu(0), gpu(1), gpu(5, index=2))
    inv = Inventory("550.54.15", "12.4", gpus=gpus)
    assert inv.gpu(5) is gpus[2]
    assert inv.gpu(2) is None  # index 2 is minor 5: lookups are by minor


def test_inventory_lists_mig_devices_of_one_parent() -> None:
    a, b = gpu(0, mig_enabled=True), gpu(1, mig_enabled=True)
    devices = (mig(a, 0), mig(b, 0), mig(a, 4))
    inv = Inventory("550.54.15", "12.4", gpus=(a, b), mig_devices=devices)
    assert inv.mig_devices_of(0) == (devices[0], devices[2])
    assert inv.mig_devices_of(3) == ()


def test_inventories_with_equal_content_compare_equal() -> None:
    # The slice publisher writes nothing when nothing changed: equality must ignore the lookup cache.
    assert Inventory("550.54.15", "12.4", gpus=(gpu(0),)) == Inventory("550.54.15", "12.4", gpus=(gpu(0),))
    assert Inventory("550.54.15", "12.4", gpus=(gpu(0),)) != Inventory("550.54.15", "12.4", gpus=(gpu(1),))


def test_model_values_are_frozen() -> None:
    g = gpu(0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.minor = 3  # type: ignore[misc]


def test_profiles_resolve_by_name_or_driver_id_not_enum() -> None:
    g = gpu(0, mig_capable=True, mig_profiles=(P3G,))
    assert g.profile("3g.40gb") is P3G
    assert g.profile(9) is P3G
    assert g.profile(2) is None  # 2 is the NVML enum, not info.id
    assert g.profile("3g.20gb") is None


def test_profile_memory_in_bytes_and_placement_slices() -> None:
    assert P3G.memory_bytes == 40448 * 1024 * 1024
    assert list(P3G.placements[1].slices) == [4, 5, 6, 7]


def test_fabric_domain_is_cluster_uuid_dot_clique() -> None:
    assert FabricInfo("9c1f7d2e-0000-4000-8000-000000000001", 7).domain_id == "9c1f7d2e-0000-4000-8000-000000000001.7"
