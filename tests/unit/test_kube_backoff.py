"""The one retry backoff: its delays, its cap, its reset after a success, and the spread of its jitter."""

from __future__ import annotations

import pytest

from agent.kube.backoff import Backoff


def test_delays_double_up_to_the_cap_and_start_again_after_a_success() -> None:
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next() == 0.5


def test_jitter_stretches_each_delay_by_up_to_its_fraction() -> None:
    draws = iter([0.0, 1.0, 0.5])
    backoff = Backoff(1.0, 4.0, jitter=0.5, rand=lambda: next(draws))
    assert [backoff.next() for _ in range(3)] == [1.0, 3.0, 5.0]  # 1 * 1.0, 2 * 1.5, 4 * 1.25


@pytest.mark.parametrize(("first", "cap", "jitter"), [(0.0, 1.0, 0.0), (2.0, 1.0, 0.0), (0.1, 1.0, -0.5)])
def test_a_backoff_that_would_never_wait_or_shrink_is_refused(first: float, cap: float, jitter: float) -> None:
    with pytest.raises(ValueError, match="a backoff needs"):
        Backoff(first, cap, jitter=jitter)
