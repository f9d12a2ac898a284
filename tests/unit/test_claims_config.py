"""Opaque device configs: what users may write in a claim, and the errors they get otherwise."""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from agent.claimconfig.config import (
    ConfigEntry,
    ConfigError,
    DeviceRef,
    GpuConfig,
    Interval,
    MigDeviceConfig,
    Mps,
    TimeSlicing,
    parse_allocation_configs,
    parse_config,
    parse_quantity,
    resolve_device_configs,
)
from tests.unit.test_claims_support import API_VERSION, DRIVER, opaque


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", **fields}


def mig_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", **fields}


# --- Quantity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1Ki", 1024),
        ("3Mi", 3 * 1024**2),
        ("2Gi", 2 * 1024**3),
        ("1.5Gi", 3 * 1024**3 // 2),
        ("500M", 500 * 10**6),
        ("8G", 8 * 10**9),
        ("250m", Fraction(1, 4)),
        ("1024", 1024),
        ("1e3", 1000),
        (".5", Fraction(1, 2)),
        (4096, 4096),
    ],
)
def test_quantity_values(text: str | int, value: int | Fraction) -> None:
    assert parse_quantity(text).value == value


def test_quantity_rounds_up_to_a_whole_number() -> None:
    assert parse_quantity("250m").ceil() == 1
    assert parse_quantity("1Gi").ceil() == 2**30


@pytest.mark.parametrize("bad", ["1GB", "Gi", "", "1.2.3", "one", "1 Gi", "5i", None, True, 1.5, [1]])
def test_quantity_rejects_malformed_input(bad: object) -> None:
    with pytest.raises(ConfigError, match="quantity"):
        parse_quantity(bad, "limit")


# --- Parsing --------------------------------------------------------------------------------------------


def test_config_without_sharing_is_exclusive() -> None:
    assert parse_config(gpu_config()) == GpuConfig(sharing=None)
    assert parse_config(mig_config()) == MigDeviceConfig(sharing=None)


@pytest.mark.parametrize("interval", list(Interval))
def test_time_slicing_intervals(interval: Interval) -> None:
    cfg = parse_config(
        gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval.value}})
    )
    assert cfg == GpuConfig(TimeSlicing(interval))


def test_time_slice_values_match_nvidia_smi() -> None:
    # nvidia-smi compute-policy --set-timeslice takes 0 (default) .. 3 (long)
    assert [i.timeslice for i in (Interval.DEFAULT, Interval.SHORT, Interval.MEDIUM, Interval.LONG)] == [0, 1, 2, 3]


def test_time_slicing_interval_defaults_to_default() -> None:
    assert parse_config(gpu_config(sharing={"strategy": "TimeSlicing"})) == GpuConfig(TimeSlicing(Interval.DEFAULT))


def test_mps_config_is_parsed_with_quantities() -> None:
    cfg = parse_config(
        gpu_config(
            sharing={
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                    "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi", "GPU-abc": "2000M"},
                },
            }
        )
    )
    assert isinstance(cfg, GpuConfig) and isinstance(cfg.sharing, Mps)
    assert cfg.sharing.active_thread_percentage == 50
    assert cfg.sharing.pinned_memory_limit is not None and cfg.sharing.pinned_memory_limit.ceil() == 10 * 2**30
    assert {k: q.ceil() for k, q in cfg.sharing.per_device_pinned_memory_limit} == {
        "0": 5 * 2**30,
        "GPU-abc": 2 * 10**9,
    }


def test_mig_config_allows_time_slicing_without_interval_and_mps() -> None:
    assert parse_config(mig_config(sharing={"strategy": "TimeSlicing"})) == MigDeviceConfig(TimeSlicing(None))
    cfg = parse_config(mig_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 10}}))
    assert cfg == MigDeviceConfig(Mps(active_thread_percentage=10))


# What the node refuses at prepare; tests/integration/test_claim_config_policy.py has kube-apiserver refuse each
# at create, with the same words.
BAD_CONFIGS: list[tuple[object, str]] = [
    # unknown fields, at every level
    (gpu_config(shareing={}), r"parameters: unknown field\(s\) 'shareing'"),
    (gpu_config(sharing={"strategy": "MPS", "extra": 1}), r"sharing: unknown field\(s\) 'extra'"),
    (
        gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short", "x": 1}}),
        r"sharing.timeSlicingConfig: unknown field\(s\) 'x'",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"activeThreads": 5}}),
        r"sharing.mpsConfig: unknown field\(s\) 'activeThreads'",
    ),
    # MIG devices cannot set a time-slice interval
    (
        mig_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        r"unknown field\(s\) 'timeSlicingConfig'",
    ),
    # wrong api version or kind
    ({"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"}, "apiVersion: want"),
    ({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"}, "kind: 'VfioDeviceConfig' is not"),
    ({"kind": "GpuConfig"}, "apiVersion"),
    ("GpuConfig", "parameters: want an object"),
    # strategies and intervals
    (gpu_config(sharing={}), "sharing.strategy: required"),
    (gpu_config(sharing={"strategy": "Exclusive"}), "'Exclusive' is not TimeSlicing or MPS"),
    (
        gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "VeryLong"}}),
        "interval: 'VeryLong' is not one of Default, Short, Medium, Long",
    ),
    (
        gpu_config(sharing={"strategy": "TimeSlicing", "mpsConfig": {}}),
        "mpsConfig: not allowed with strategy TimeSlicing",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "timeSlicingConfig": {}}),
        "timeSlicingConfig: not allowed with strategy MPS",
    ),
    # MPS values
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
        "0 is outside 1..100",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}}),
        "101 is outside 1..100",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}}),
        "want an integer",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10GB"}}),
        "defaultPinnedDeviceMemoryLimit: '10GB' is not a quantity",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "-1Gi"}}),
        "must be positive",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {"first": "1Gi"}}}),
        "key must be a device index or a GPU-/MIG- UUID",
    ),
    (
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": ["1Gi"]}}),
        "want a map",
    ),
]


@pytest.mark.parametrize(("params", "error"), BAD_CONFIGS)
def test_bad_configs_are_rejected_with_the_field_named(params: object, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_config(params)


# --- Selecting and resolving ----------------------------------------------------------------------------


def ts(interval: str) -> dict[str, Any]:
    return {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}


def test_other_drivers_configs_are_ignored_even_when_invalid_for_us() -> None:
    foreign = {"source": "FromClaim", "opaque": {"driver": "net.example.com", "parameters": {"anything": 1}}}
    assert parse_allocation_configs([foreign], DRIVER) == []


def test_a_bad_config_entry_names_its_position_and_source() -> None:
    with pytest.raises(ConfigError, match=r"config\[1\] \(FromClass\): sharing.strategy"):
        parse_allocation_configs([opaque(), opaque(source="FromClass", sharing={"strategy": "x"})], DRIVER)


def test_claim_configs_override_class_configs_and_later_wins() -> None:
    entries = parse_allocation_configs(
        [
            opaque(sharing=ts("Short")),  # claim, first
            opaque(source="FromClass", sharing=ts("Long")),  # class: lowest precedence although listed later
            opaque(sharing=ts("Medium")),  # claim, last: wins
        ],
        DRIVER,
    )
    [cfg] = resolve_device_configs(entries, [DeviceRef("gpu", "gpu-0", "gpu", "GPU-0")])
    assert cfg.sharing == TimeSlicing(Interval.MEDIUM)


def test_class_config_applies_when_the_claim_has_none_for_that_request() -> None:
    entries = parse_allocation_configs(
        [opaque(source="FromClass", sharing=ts("Long")), opaque(requests=["other"], sharing=ts("Short"))], DRIVER
    )
    [cfg] = resolve_device_configs(entries, [DeviceRef("gpu", "gpu-0", "gpu", "GPU-0")])
    assert cfg.sharing == TimeSlicing(Interval.LONG)


def test_configs_apply_only_to_listed_requests_including_subrequests() -> None:
    entries = parse_allocation_configs([opaque(requests=["a"], sharing=ts("Short"))], DRIVER)
    a, b = resolve_device_configs(
        entries, [DeviceRef("a/large", "gpu-0", "gpu", "GPU-0"), DeviceRef("b", "gpu-1", "gpu", "GPU-1")]
    )
    assert a.sharing == TimeSlicing(Interval.SHORT)
    assert b.sharing is None and not b.shared


def test_gpu_config_naming_a_mig_request_is_an_error() -> None:
    entries = parse_allocation_configs([opaque(requests=["mig"], sharing=ts("Short"))], DRIVER)
    with pytest.raises(ConfigError, match="is a mig device: it takes MigDeviceConfig, not GpuConfig"):
        resolve_device_configs(entries, [DeviceRef("mig", "gpu-4-mig-1g10gb-19-0", "mig", "MIG-1")])


def test_mig_config_naming_a_gpu_request_is_an_error() -> None:
    entries = parse_allocation_configs([opaque("MigDeviceConfig", requests=["gpu"])], DRIVER)
    with pytest.raises(ConfigError, match="takes GpuConfig, not MigDeviceConfig"):
        resolve_device_configs(entries, [DeviceRef("gpu", "gpu-0", "gpu", "GPU-0")])


def test_a_claim_wide_config_applies_only_to_devices_of_its_kind() -> None:
    """Tried: one request-less GpuConfig on a claim holding a GPU and a MIG device (NVIDIA's driver accepts
    it and leaves the MIG device unconfigured); a request-less MigDeviceConfig before it serves the MIG device."""
    devices = [DeviceRef("gpu", "gpu-0", "gpu", "GPU-0"), DeviceRef("mig", "gpu-4-mig-1g10gb-19-0", "mig", "MIG-1")]
    gpu_cfg, mig_cfg = resolve_device_configs(parse_allocation_configs([opaque(sharing=ts("Short"))], DRIVER), devices)
    assert isinstance(gpu_cfg.sharing, TimeSlicing)
    assert (mig_cfg.kind, mig_cfg.sharing) == ("MigDeviceConfig", None)
    both = [opaque("MigDeviceConfig", sharing={"strategy": "MPS"}), opaque(sharing=ts("Short"))]
    gpu_cfg, mig_cfg = resolve_device_configs(parse_allocation_configs(both, DRIVER), devices)
    assert isinstance(gpu_cfg.sharing, TimeSlicing)
    assert isinstance(mig_cfg.sharing, Mps)


def test_a_claim_wide_config_that_fits_no_device_is_an_error() -> None:
    """NVIDIA's driver skips it, so the sharing it asks for silently never happens; here the claim fails."""
    mig = [DeviceRef("mig", "gpu-4-mig-1g10gb-19-0", "mig", "MIG-1")]
    with pytest.raises(
        ConfigError,
        match=r"the FromClaim GpuConfig for every request configures no device: the "
        r"claim's devices \(gpu-4-mig-1g10gb-19-0\) take MigDeviceConfig",
    ):
        resolve_device_configs(parse_allocation_configs([opaque(sharing=ts("Short"))], DRIVER), mig)
    gpus = [DeviceRef("gpu", "gpu-0", "gpu", "GPU-0")]
    with pytest.raises(ConfigError, match="MigDeviceConfig for every request configures no device"):
        resolve_device_configs(parse_allocation_configs([opaque("MigDeviceConfig")], DRIVER), gpus)


def test_mps_per_device_limits_by_index_and_uuid() -> None:
    mps = {
        "strategy": "MPS",
        "mpsConfig": {
            "defaultPinnedDeviceMemoryLimit": "4Gi",
            "defaultPerDevicePinnedMemoryLimit": {"1": "1Gi", "GPU-2": "2Gi"},
        },
    }
    entries = parse_allocation_configs([opaque(sharing=mps)], DRIVER)
    devices = [DeviceRef("gpu", f"gpu-{i}", "gpu", f"GPU-{i}") for i in range(3)]
    limits = [
        c.pinned_memory_limit.ceil() if c.pinned_memory_limit else None
        for c in resolve_device_configs(entries, devices)
    ]
    assert limits == [4 * 2**30, 1 * 2**30, 2 * 2**30]


@pytest.mark.parametrize(("key", "error"), [("5", "index 5 is out of range"), ("GPU-9", "GPU-9 is not a device")])
def test_mps_per_device_limit_for_a_device_not_in_the_claim(key: str, error: str) -> None:
    mps = {"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {key: "1Gi"}}}
    entries = parse_allocation_configs([opaque(sharing=mps)], DRIVER)
    with pytest.raises(ConfigError, match=error):
        resolve_device_configs(entries, [DeviceRef("gpu", "gpu-0", "gpu", "GPU-0")])


def test_entries_keep_source_and_requests() -> None:
    [entry] = parse_allocation_configs([opaque(requests=["r1"], source="FromClass")], DRIVER)
    assert entry == ConfigEntry("FromClass", ("r1",), GpuConfig())
