"""`--partitionable-devices` publishes only what prepare can deliver: each published device of a GPU is
prepared (through the real pynvml wrappers over the NVML fake, MIG devices created and MIG mode switched as
needed), unprepared, and the GPU ends as it began.

Stock DGX H100 (MIG mode off everywhere): Hopper switches MIG mode at once, so both the whole GPU and its
placements are offered, and prepare turns MIG mode on for a placement. DGX A100 with GPU 0 in MIG mode:
Ampere needs a reset for that, so GPU 0 offers placements only and the others the whole GPU only.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pynvml
import pytest

from agent.claims import cdi
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef
from agent.devices.model import Inventory
from agent.devices.names import GpuName, parse_device_name
from agent.nvml.migctl import MigControl
from agent.nvml.source import NvmlSource, open_nvml
from agent.slices.build import pool_content
from tests.claim_sources import StaticClaimSource
from tests.unit.test_claims_support import DRIVER, NODE, claim


def published(inventory: Inventory) -> list[str]:
    return [d["name"] for content in pool_content(inventory, partitionable=True) for d in content.devices]


def by_gpu(names: list[str]) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for name in names:
        parsed = parse_device_name(name)
        out.setdefault(parsed.minor if isinstance(parsed, GpuName) else parsed.parent_minor, []).append(name)
    return out


class Node:
    def __init__(self, nvml: NvmlSource, root: pathlib.Path) -> None:
        self.nvml = nvml
        self.inventory = nvml.discover()
        self.source = StaticClaimSource()
        self.preparer = ClaimPreparer(
            PrepareSettings(
                node_name=NODE,
                driver_name=DRIVER,
                inventory=lambda: self.inventory,
                mig_caps=cdi.MigCaps(lambda: None),
                migs=MigControl(),
                on_inventory_changed=self.rediscover,
            ),
            state_dir=root / "state",
            cdi_root=root / "cdi",
            source=self.source,
            boot_id=lambda: "boot-1",
        )

    def rediscover(self) -> None:
        self.inventory = self.nvml.discover()

    def prepare_and_unprepare(self, device: str, n: int) -> str:
        uid = f"uid-{n}"
        self.source.put(claim(uid, [device], request="r"))
        ref = ClaimRef("default", uid, f"claim-{uid}")
        result = self.preparer.prepare([ref])[uid]
        if result.error:
            return result.error
        assert [d.device_name for d in result.devices] == [device]
        return self.preparer.unprepare([ref])[uid]


@pytest.fixture
def h100(tmp_path: pathlib.Path) -> Iterator[Node]:
    with open_nvml("fake:dgx-h100") as nvml:
        yield Node(nvml, tmp_path)


@pytest.fixture
def a100(tmp_path: pathlib.Path) -> Iterator[Node]:
    with open_nvml("fake:dgx-a100-40gb") as nvml:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_ERROR_RESET_REQUIRED
        nvml.fake.reset_gpu(0)  # Ampere: the mode takes effect at a reset
        yield Node(nvml, tmp_path)


def test_every_device_published_for_a_stock_dgx_h100_can_be_prepared(h100: Node) -> None:
    before = h100.inventory
    names = by_gpu(published(before))
    assert len(names) == 8 and all(len(devices) == 26 for devices in names.values())  # whole GPU + 25 placements
    # Every device of GPU 0 and the whole of every GPU (each GPU's placements are alike).
    tried = names[0] + [devices[0] for minor, devices in names.items() if minor]
    failed = {device: error for n, device in enumerate(tried) if (error := h100.prepare_and_unprepare(device, n))}
    assert failed == {}
    h100.rediscover()
    assert h100.inventory == before  # MIG mode off again, no instance left


def test_an_a100_offers_only_the_form_its_mig_mode_allows(a100: Node) -> None:
    before = a100.inventory
    names = by_gpu(published(before))
    assert "gpu-0" not in names[0] and len(names[0]) == 25  # MIG mode on: the placements, not the GPU
    assert all(devices == [f"gpu-{minor}"] for minor, devices in names.items() if minor)  # off: the whole GPU
    tried = names[0] + [devices[0] for minor, devices in names.items() if minor]
    failed = {device: error for n, device in enumerate(tried) if (error := a100.prepare_and_unprepare(device, n))}
    assert failed == {}
    a100.rediscover()
    assert a100.inventory == before
    # What is not published is refused, not half done: the whole GPU 0 needs MIG mode off (a reset).
    assert "has MIG mode enabled" in a100.prepare_and_unprepare("gpu-0", 99)
    assert "does not have MIG mode enabled" in a100.prepare_and_unprepare("gpu-1-mig-1g5gb-19-0", 100)
