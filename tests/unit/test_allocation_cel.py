"""One DRA CEL environment: the local allocator sees devices as kube-scheduler sees the published slices."""

from __future__ import annotations

import pytest

from agent.allocation.catalog import NodeUsage, candidates
from agent.allocation.cel import DeviceSelector, MissingAttribute, SelectorError, device_variable
from agent.allocation.selectors import CelSelectors
from agent.slices.build import build_resource_slices
from tests.unit.test_slices_factory import dgx_h100, h100, mig_device, nvswitch_inventory

DRIVER = "gpu.nvidia.com"

# Selectors over what both views carry; each must give the same answer on both.
SHARED_SELECTORS = [
    "device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'",
    "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('550.54.15')) >= 0",
    "device.attributes['gpu.nvidia.com'].driverVersion.isLessThan(semver('550.100.0'))",
    "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 9",
    "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) == 0",
    "device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('81e9'))",
    "device.capacity['gpu.nvidia.com'].memory.sub(quantity('40Gi')).asInteger() == 42949672960",
    "device.attributes['gpu.nvidia.com'].minor < 2",
    "device.attributes['example.com'].size() == 0",
    "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'",  # whole GPUs have no profile: an error
]


def scheduler_view(expression: str, device: dict) -> bool | str:
    try:
        return DeviceSelector(expression).matches(device_variable(DRIVER, device))
    except MissingAttribute:
        return "missing"


def allocator_view(expression: str, env: object) -> bool | str:
    try:
        return DeviceSelector(expression).matches(env)  # type: ignore[arg-type]
    except MissingAttribute:
        return "missing"


@pytest.mark.parametrize("expression", SHARED_SELECTORS)
def test_local_allocator_and_scheduler_agree(expression: str) -> None:
    # GPU 2 differs (an A100-like 40 GiB, compute capability 8.0) so that selectors split the devices.
    inv = nvswitch_inventory([h100(0), h100(1), h100(2, memory_bytes=40 << 30, cuda_compute_capability="8.0")])
    published = {d["name"]: d for s in build_resource_slices(inv, "node-a") for d in s["spec"]["devices"]}
    offered = {c.name: c.env for c in candidates(inv, NodeUsage())}
    assert offered.keys() == published.keys()
    answers = {name: allocator_view(expression, env) for name, env in offered.items()}
    assert answers == {name: scheduler_view(expression, d) for name, d in published.items()}


def test_selectors_see_mig_capacities_as_quantities() -> None:
    gpu = h100(0, mig_enabled=True)
    inv = nvswitch_inventory([gpu], (mig_device(gpu, "1g.10gb", 0),))
    offered = candidates(inv, NodeUsage())
    small = "device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('11Gi'))"
    matched = {c.name for c in offered if CelSelectors().matches(small, c.env)}
    assert matched == {c.name for c in offered if c.mig_profile and c.mig_profile.memory_bytes < 11 << 30}
    assert "gpu-0-mig-1g10gb-19-0" in matched  # the existing one, and the possible placements beside it


def test_missing_attribute_is_no_match_for_the_allocator_but_an_error_for_the_scheduler() -> None:
    # Tried: a selector on `profile`, which whole GPUs lack, without a has() guard.
    expression = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
    (gpu,) = (c for c in candidates(dgx_h100(), NodeUsage()) if c.name == "gpu-0")
    assert CelSelectors().matches(expression, gpu.env) is False
    with pytest.raises(MissingAttribute, match="profile"):
        DeviceSelector(expression).matches(gpu.env)


def test_other_selector_errors_still_reach_the_allocator_caller() -> None:
    (gpu,) = (c for c in candidates(dgx_h100(), NodeUsage()) if c.name == "gpu-0")
    selectors = CelSelectors()
    # Tried: comparing a quantity with a version, and a selector that is not a bool.
    with pytest.raises(SelectorError, match="compareTo"):
        selectors.matches("device.capacity['gpu.nvidia.com'].memory.compareTo(semver('1.0.0')) > 0", gpu.env)
    with pytest.raises(SelectorError, match="must give a bool"):
        selectors.matches("device.driver", gpu.env)
    with pytest.raises(SelectorError, match="not a quantity"):
        selectors.matches("device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('1e99999'))", gpu.env)


def test_quantity_literals_accept_every_kubernetes_spelling() -> None:
    for text in ("85899345920", "80Gi", "8.589934592e10", "85899345920000m"):
        assert DeviceSelector(f"quantity('{text}') == quantity('80Gi')").matches(device_variable(DRIVER, {}))
