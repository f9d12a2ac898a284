"""What the machine did while a bench was timed: CPU time by process and in all, and how long threads waited for
a CPU. On the shared 2-core VM other people's work takes CPUs from ours; these tell that time apart."""

from __future__ import annotations

import os
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


def run_queue_ms(pids: Iterable[int]) -> float:
    """Milliseconds the threads of `pids` have spent runnable but waiting for a CPU (schedstat's second field),
    summed; a thread that ends meanwhile drops out, so take differences over short spans."""
    total = 0
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_bytes().split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # the thread ended while being read
    return total / 1e6
