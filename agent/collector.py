"""Python's garbage collector, tuned for a long-running controller, and the CPU it uses.

An informer keeps the newest version of every object, so each watch event leaves behind a few dozen dicts and
lists that live a second or two and die by reference counting. With the default threshold (a collection of
the youngest generation every 700 allocations) each of them is traversed by the collector once or twice
before it dies, and a full collection traverses everything still held. In the arbiter's bench (1,000 pods on
the real control plane) that was 0.36 s of CPU, a third of a millisecond per admitted pod; every 50,000
allocations instead, 0.02 s. The objects that need the collector at all are few (the core's sessions hold
cycles between jobs and their pods: about 1,000 objects a cycle), so collecting them later costs little memory.
"""

from __future__ import annotations

import gc
import time
from typing import Any

YOUNG_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python's default: 700)


def settle(young_threshold: int | None = None) -> None:
    """Once started: what start-up built (modules, clients, inventories, the informers' first lists) lives as
    long as the process, so it is frozen out of every later collection (a full one of everything took 15 ms in
    the node bench). `young_threshold`: the youngest generation collected every that many allocations."""
    gc.collect()
    gc.freeze()
    if young_threshold is not None:
        _, middle, oldest = gc.get_threshold()
        gc.set_threshold(young_threshold, middle, oldest)


class CollectorTime:
    """The CPU seconds the collector used while installed, by generation (0 youngest); measured on the clock
    of the thread each collection ran in (one at a time: a collection holds the GIL)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.collections = [0, 0, 0]
        self._started = 0.0

    def install(self) -> CollectorTime:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.thread_time()
            return
        generation = int(info["generation"])
        self.seconds[generation] += time.thread_time() - self._started
        self.collections[generation] += 1
