"""Consumable capacity: request-policy rounding as upstream's allocator does it, share accounting, publishing."""

from __future__ import annotations

from fractions import Fraction

import pytest

from agent.devices import shares
from agent.devices.shares import Capacity, Policy, ShareMode

GI = 1 << 30
MI = 1 << 20
H100 = 81559 * MI  # 79.6 GiB, what NVML reports for an H100 80GB HBM3


def memory_policy() -> Capacity:
    return shares.capacities(H100, ShareMode("memory"))["memory"]


def test_a_request_below_the_minimum_is_raised_to_it() -> None:
    capacity = Capacity(
        Fraction(100), Policy(default=Fraction(10), min=Fraction(10), max=Fraction(100), step=Fraction(5))
    )
    assert shares.consumed(Fraction(3), capacity) == 10


def test_a_request_is_rounded_up_to_the_next_step_from_the_minimum() -> None:
    capacity = Capacity(
        Fraction(100), Policy(default=Fraction(10), min=Fraction(10), max=Fraction(100), step=Fraction(5))
    )
    assert shares.consumed(Fraction(11), capacity) == 15
    assert shares.consumed(Fraction(15), capacity) == 15
    assert shares.consumed(Fraction(7, 2) * 4, capacity) == 15  # 14 -> 15


def test_memory_mode_rounds_to_whole_mebibytes() -> None:
    assert shares.consumed(Fraction(8 * GI + 1), memory_policy()) == 8 * GI + MI
    assert shares.consumed(Fraction(1), memory_policy()) == MI  # the minimum


def test_no_request_takes_the_default_and_no_policy_the_whole_capacity() -> None:
    assert shares.consumed(None, memory_policy()) == H100  # memory mode: a claim naming no memory takes it all
    assert shares.consumed(None, Capacity(Fraction(40))) == 40
    assert shares.consumed(Fraction(7), Capacity(Fraction(40))) == 7


def test_valid_values_round_up_to_the_next_listed_value() -> None:
    capacity = Capacity(Fraction(8), Policy(default=Fraction(1), valid_values=(Fraction(1), Fraction(2), Fraction(4))))
    assert shares.consumed(Fraction(3), capacity) == 4
    assert shares.violates(Fraction(4), capacity.policy) is False
    assert shares.consumed(Fraction(5), capacity) == 5
    assert shares.violates(Fraction(5), capacity.policy) is True  # above every value: the device is skipped


def test_a_request_above_the_maximum_violates_the_policy() -> None:
    assert shares.share_of({"memory": Fraction(80 * GI)}, shares.capacities(H100, ShareMode("memory"))) is None


def test_a_request_for_a_capacity_the_device_lacks_cannot_be_served() -> None:
    assert shares.share_of({"cores": Fraction(1)}, shares.capacities(H100, ShareMode("memory"))) is None


def test_nine_8gi_shares_fit_an_h100_and_the_tenth_does_not() -> None:
    capacities = shares.capacities(H100, ShareMode("memory"))
    share = shares.share_of({"memory": Fraction(8 * GI)}, capacities)
    assert share == {"memory": 8 * GI, "shares": 1}
    assert shares.fits(share, capacities, [share] * 8)
    assert not shares.fits(share, capacities, [share] * 9)


def test_count_mode_limits_shares_not_memory() -> None:
    capacities = shares.capacities(H100, ShareMode("count", 4))
    share = shares.share_of({}, capacities)
    assert share == {"memory": 0, "shares": 1}
    assert shares.fits(share, capacities, [share] * 3)
    assert not shares.fits(share, capacities, [share] * 4)


def test_unlimited_mode_has_no_share_count() -> None:
    capacities = shares.capacities(H100, ShareMode("unlimited"))
    assert set(capacities) == {"memory"}
    assert shares.share_of({}, capacities) == {"memory": 0}


def test_the_published_memory_is_on_the_step_grid() -> None:
    odd = H100 + 12345
    capacity = shares.capacities(odd, ShareMode("memory"))["memory"]
    assert capacity.value == H100
    assert capacity.policy is not None and capacity.policy.max == H100
    assert shares.capacity_json({"memory": capacity})["memory"] == {
        "value": "81559Mi",
        "requestPolicy": {"default": "81559Mi", "validRange": {"min": "1Mi", "max": "81559Mi", "step": "1Mi"}},
    }


def test_nine_8gi_shares_count_as_72_of_79_6_gib() -> None:
    assert shares.gpu_fraction(9 * 8 * GI, H100) == pytest.approx(72 / 79.647, abs=1e-4)


@pytest.mark.parametrize("text", ["", "disabled", None])
def test_off(text: str | None) -> None:
    assert shares.parse_mode(text) is None


@pytest.mark.parametrize(
    ("text", "mode"),
    [("memory", ShareMode("memory")), ("unlimited", ShareMode("unlimited")), ("4", ShareMode("count", 4))],
)
def test_modes(text: str, mode: ShareMode) -> None:
    assert shares.parse_mode(text) == mode


@pytest.mark.parametrize("text", ["-1", "lots", "1.5", "100000"])
def test_bad_modes_say_what_is_wanted(text: str) -> None:
    with pytest.raises(shares.ShareError, match="disabled, memory, unlimited"):
        shares.parse_mode(text)


def test_fractional_values_are_written_as_quantities() -> None:
    assert shares.to_quantities({"cores": Fraction(1, 2), "memory": Fraction(8 * GI)}) == {
        "cores": "500m",
        "memory": "8Gi",
    }
    assert shares.consumed(Fraction(3, 2), Capacity(Fraction(4))) == Fraction(3, 2)  # no policy: as asked
