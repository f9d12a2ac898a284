"""DRA's CEL selector environment in the fake scheduler: device shape, quantity and semver libraries, errors."""

from __future__ import annotations

import pytest

from agent.allocation.cel import DeviceSelector, SelectorError, device_variable

DRIVER = "gpu.nvidia.com"


def gpu(memory: str = "81559Mi", driver_version: str = "550.54.15", **attributes: dict[str, object]) -> dict:
    return {
        "name": "gpu-0",
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "driverVersion": {"version": driver_version},
            "minor": {"int": 0},
            "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
            **attributes,
        },
        "capacity": {"memory": {"value": memory}},
    }


def holds(expression: str, device: dict | None = None) -> bool:
    return DeviceSelector(expression).matches(device_variable(DRIVER, device or gpu()))


@pytest.mark.parametrize(
    ("memory", "expected"),
    [("81559Mi", True), ("40Gi", True), ("40959Mi", False), ("20Gi", False)],
)
def test_capacity_compare_to_a_quantity(memory: str, expected: bool) -> None:
    selector = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
    assert holds(selector, gpu(memory=memory)) is expected


def test_quantity_greater_and_less_than() -> None:
    assert holds("device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('79Gi'))")
    assert not holds("device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('80Gi'))")
    assert holds("device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('80Gi'))")


def test_quantities_compare_by_value_not_spelling() -> None:
    assert holds("quantity('1Gi') == quantity('1024Mi')")
    assert holds("quantity('1500m').compareTo(quantity('1.5')) == 0")
    assert holds("quantity('1k').isGreaterThan(quantity('999'))")
    assert holds("quantity('1Gi').add(quantity('1Gi')) == quantity('2Gi') && quantity('3').sub(1).asInteger() == 2")
    assert holds("isQuantity('80Gi') && !isQuantity('eighty')")


@pytest.mark.parametrize(
    ("version", "expected"),
    [("550.54.15", True), ("535.104.5", False), ("560.0.0-rc.1", True), ("550.54.14", False)],
)
def test_version_attributes_compare_as_semver(version: str, expected: bool) -> None:
    selector = "device.attributes['gpu.nvidia.com'].driverVersion.compareTo(semver('550.54.15')) >= 0"
    assert holds(selector, gpu(driver_version=version)) is expected


def test_semver_precedence_and_parts() -> None:
    assert holds("semver('1.0.0-rc.1').isLessThan(semver('1.0.0'))")
    assert holds("semver('1.0.0-alpha.2').isLessThan(semver('1.0.0-alpha.10'))")  # numeric, not text, order
    assert holds("semver('1.0.0+build.7') == semver('1.0.0')")  # build metadata does not count
    assert holds("device.attributes['gpu.nvidia.com'].driverVersion.major() == 550")
    assert holds("isSemver('1.2.3') && !isSemver('1.2') && !isSemver('v1.2.3')")


def test_attributes_live_under_their_domain() -> None:
    assert holds("device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'")
    assert holds("device.attributes['gpu.nvidia.com'].minor == 0")
    assert holds("device.attributes['resource.kubernetes.io'].pciBusID == '0000:18:00.0'")
    assert not holds("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA A100-SXM4-40GB'")


def test_an_unknown_domain_is_an_empty_map() -> None:
    assert holds("device.attributes['example.com'].size() == 0")
    assert holds("!has(device.attributes['example.com'].model)")


def test_a_missing_attribute_is_an_error_naming_it() -> None:
    # Tried: a selector on an attribute MIG-less GPUs do not have, without a has() guard.
    with pytest.raises(SelectorError, match="profile"):
        holds("device.attributes['gpu.nvidia.com'].profile == '1g.10gb'")


def test_selector_that_does_not_compile() -> None:
    # Tried: an expression cut short.
    with pytest.raises(SelectorError, match="does not compile"):
        DeviceSelector("device.driver ==")


def test_selector_must_give_a_bool() -> None:
    # Tried: an expression that evaluates to a string.
    with pytest.raises(SelectorError, match="must give a bool"):
        holds("device.driver")


def test_comparing_a_quantity_with_a_version_is_an_error() -> None:
    # Tried: compareTo across types, which Kubernetes rejects too.
    with pytest.raises(SelectorError, match="compareTo"):
        holds("device.capacity['gpu.nvidia.com'].memory.compareTo(semver('1.0.0')) > 0")


def test_bad_quantity_literal_is_an_error() -> None:
    # Tried: quantity() of text that is no quantity.
    with pytest.raises(SelectorError, match="not a quantity"):
        holds("device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('forty gigs'))")
