"""agent.collector: the collector settled once a controller has started (start-up frozen out, the youngest
generation collected less often), and the CPU each generation's collections use, counted while installed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from agent import collector


@pytest.fixture
def restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored")
def test_settle_freezes_what_start_up_built_and_keeps_the_older_generations_thresholds() -> None:
    gc.unfreeze()
    built = [{"kept": [i]} for i in range(1000)]  # what a start-up keeps: out of every later collection
    _, middle, oldest = gc.get_threshold()
    collector.settle(collector.YOUNG_THRESHOLD)
    assert gc.get_freeze_count() >= len(built)
    assert gc.get_threshold() == (collector.YOUNG_THRESHOLD, middle, oldest)


@pytest.mark.usefixtures("restored")
def test_settle_without_a_threshold_leaves_it_as_it_was() -> None:
    before = gc.get_threshold()
    collector.settle()
    assert gc.get_threshold() == before


def test_collections_are_counted_by_generation_while_installed() -> None:
    """What is tried: a collection of the youngest generation and a full one while installed, then a full one
    after uninstalling, which is not counted."""
    time = collector.CollectorTime().install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        time.uninstall()
    counted = list(time.collections)
    gc.collect(2)
    assert counted[0] >= 1 and counted[2] == 1
    assert time.seconds[2] > 0.0
    assert time.collections == counted
