"""The NVML fake against what real GPUs reported: each file in tests/fixtures/nvml is one real GPU's reading
(`gpu-dra-agent inventory --nvml real --output json`, taken on a GPU machine by tests/gpu/on_gpu_machine.sh),
and the fake machine it names must report the same product, memory, MIG profiles and placements."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from agent.commands.inventory import inventory_document
from agent.nvml.source import open_nvml

RECORDINGS = sorted((pathlib.Path(__file__).parents[1] / "fixtures" / "nvml").glob("*.json"))
COMPARED = (
    "productName",
    "architecture",
    "cudaComputeCapability",
    "memoryBytes",
    "pciDeviceID",
    "migCapable",
    "migProfiles",
    "migPlacements",
)


@pytest.mark.parametrize("recording", RECORDINGS, ids=lambda p: p.stem)
def test_the_fake_reports_what_the_real_gpu_did(recording: pathlib.Path) -> None:
    # Found this way: the fake H200's MIG profiles were 1.07x to 0.98x the real memory sizes (1g.18gb: 17,536
    # MiB in the fake, 16,384 on the GPU), taken from the profile names before a GPU was at hand.
    real: dict[str, Any] = json.loads(recording.read_text())
    with open_nvml(f"fake:{real['fakeMachine']}") as nvml:
        doc = inventory_document(nvml.discover())
    for gpu in doc["gpus"]:
        assert comparable(gpu) == comparable(real["gpu"]), gpu["name"]


def comparable(gpu: dict[str, Any]) -> dict[str, Any]:
    """The GPU's reading without what names its place in the machine (placements are named after the GPU)."""
    placements = [{k: v for k, v in p.items() if k != "name"} for p in gpu["migPlacements"]]
    return {**{k: gpu[k] for k in COMPARED}, "migPlacements": placements}
