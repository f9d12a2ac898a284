"""What the machine did while a bench was timed: CPU time by process and in all, and how long threads waited for
a CPU. On the shared 2-core VM other people's work takes CPUs from ours; these tell that time apart."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path


def jiffies() -> tuple[int, int]:
    """The machine's CPU time so far, all and idle (with I/O wait), in clock ticks."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields), fields[3] + fields[4]


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_times_ms(pids: Iterable[int]) -> tuple[float, float]:
    """Milliseconds the threads of `pids` have spent on a CPU, and runnable but waiting for one (schedstat's
    first two fields), each summed over the threads; a thread that ends meanwhile drops out, so take
    differences over short spans."""
    on_cpu = waiting = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                fields = (task / "schedstat").read_bytes().split()
                on_cpu, waiting = on_cpu + int(fields[0]), waiting + int(fields[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # the thread ended while being read
    return on_cpu / 1e6, waiting / 1e6


class Busy:
    """CPU use while a span runs, in cores: the whole machine's, and each of `processes` (name -> pid)."""

    def __init__(self, processes: dict[str, int]) -> None:
        self.processes = processes
        self.machine = 0.0
        self.ours: dict[str, float] = {}

    def __enter__(self) -> Busy:
        self._cpu = {name: cpu_seconds(pid) for name, pid in self.processes.items()}
        self._jiffies = jiffies()
        self._began = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        seconds = time.perf_counter() - self._began
        total, idle = jiffies()
        cores = os.cpu_count() or 1
        self.machine = cores * (1 - (idle - self._jiffies[1]) / max(1, total - self._jiffies[0]))
        self.ours = {name: (cpu_seconds(pid) - self._cpu[name]) / seconds for name, pid in self.processes.items()}

    def describe(self) -> str:
        ours = sum(self.ours.values())
        each = ", ".join(f"{name} {cores:.2f}" for name, cores in self.ours.items())
        return (
            f"machine: {self.machine:.2f} of {os.cpu_count()} CPUs busy; ours {ours:.2f} ({each}), "
            f"others {max(0.0, self.machine - ours):.2f}"
        )
