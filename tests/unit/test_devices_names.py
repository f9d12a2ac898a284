"""Canonical device names: the contract with NVIDIA's DRA driver, and their parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.devices.names import (
    GpuName,
    InvalidDeviceName,
    MigName,
    canonical,
    gpu_device_name,
    mig_device_name,
    parse_device_name,
    profile_token,
)


def test_gpu_names_use_the_minor_number() -> None:
    assert gpu_device_name(3) == "gpu-3"
    assert parse_device_name("gpu-3") == GpuName(3)


def test_mig_names_carry_profile_id_and_placement_start() -> None:
    assert mig_device_name(0, "1g.10gb", 19, 4) == "gpu-0-mig-1g10gb-19-4"
    assert mig_device_name(7, "3g.40gb", 9, 4) == "gpu-7-mig-3g40gb-9-4"


def test_the_media_engine_suffix_becomes_a_dns_safe_token() -> None:
    name = mig_device_name(2, "1g.10gb+me", 20, 6)
    assert name == "gpu-2-mig-1g10gb-me-20-6"
    assert parse_device_name(name) == MigName(2, "1g10gb-me", 20, 6)


@given(
    st.integers(0, 4096),
    st.sampled_from(["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb", "1c.2g.20gb"]),
    st.integers(0, 99),
    st.integers(0, 7),
)
def test_every_mig_name_parses_back(minor: int, profile: str, gi_id: int, start: int) -> None:
    parsed = parse_device_name(mig_device_name(minor, profile, gi_id, start))
    assert parsed == MigName(minor, profile_token(profile), gi_id, start)
    assert str(parsed) == mig_device_name(minor, profile, gi_id, start)


@given(st.integers(0, 10**6))
def test_every_gpu_name_parses_back(minor: int) -> None:
    assert str(parse_device_name(gpu_device_name(minor))) == gpu_device_name(minor)


@pytest.mark.parametrize(
    "bad",
    [
        "",  # nothing
        "gpu",  # no minor
        "gpu-",  # empty minor
        "gpu--1",  # negative minor
        "GPU-0",  # upper case: device names are DNS labels
        "gpu-0-mig",  # MIG without profile, id and start
        "gpu-0-mig-1g10gb-19",  # MIG without placement start
        "gpu-0-mig-1g.10gb-19-0",  # dotted profile is not DNS safe
        "gpu-0-mig-1g10gb+me-20-0",  # '+' is not DNS safe
        "gpu-a",  # minor not a number
        " gpu-0",  # stray whitespace
        "mig-0",  # someone else's naming
    ],
)
def test_strings_that_are_not_device_names_are_rejected(bad: str) -> None:
    with pytest.raises(InvalidDeviceName, match="not a device name"):
        parse_device_name(bad)


@pytest.mark.parametrize(
    ("spelling", "published"),
    [
        ("gpu-01", "gpu-1"),
        ("gpu-001", "gpu-1"),
        ("gpu-00", "gpu-0"),
        ("gpu-02-mig-1g10gb-19-3", "gpu-2-mig-1g10gb-19-3"),
        ("gpu-2-mig-1g10gb-019-3", "gpu-2-mig-1g10gb-19-3"),
        ("gpu-2-mig-1g10gb-19-03", "gpu-2-mig-1g10gb-19-3"),
    ],
)
def test_only_the_published_spelling_of_a_device_is_accepted(spelling: str, published: str) -> None:
    # Tried: leading zeros, which name the same device as the published name and would dodge string checks.
    with pytest.raises(InvalidDeviceName, match=f"not a canonical device name.*would be {published}"):
        parse_device_name(spelling)
    assert canonical(spelling) == published
    assert canonical(published) == published


@pytest.mark.parametrize("bad", ["gpu-1\n", "gpu-\u0661", "gpu-1-mig-1g10gb-19-\u0663", "gpu-" + "9" * 5000])
def test_newlines_unicode_digits_and_huge_numbers_are_no_device_names(bad: str) -> None:
    with pytest.raises(InvalidDeviceName, match="not a device name"):
        parse_device_name(bad)
    assert canonical(bad) == bad  # matches no device
