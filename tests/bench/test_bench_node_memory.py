"""The node daemon's resident memory at idle: `gpu-dra-agent node` as a subprocess on fake:dgx-h100 against the
API fake, sampled once its slices are published and the kubelet plugin serves.

Opt-in: `make bench`. Prints VmRSS (MiB) per start.
"""

from __future__ import annotations

import os
import pathlib
import statistics
import time

import pytest

import fakes.apiserver
from tests.integration.test_node_support import Daemon, create_node, eventually, running, short_tmpdir

STARTS = int(os.environ.get("NODE_MEMORY_STARTS", "5"))
SETTLE_S = 3.0


def _rss_mib(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@pytest.mark.bench
def test_idle_resident_memory_of_the_node_agent() -> None:
    samples: list[float] = []
    for _ in range(STARTS):
        with short_tmpdir("mem-") as root, fakes.apiserver.start(port=0) as server:
            create_node(server.api_client())
            daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
            started = time.monotonic()
            with running(daemon):
                serving_s = time.monotonic() - started
                eventually(lambda: bool(server.store.objects("ResourceSlice")), "slices published")
                time.sleep(SETTLE_S)
                assert daemon.proc is not None
                pid = daemon.proc.pid
                rss = _rss_mib(pid)
                samples.append(rss)
                print(f"node agent idle: VmRSS {rss:.1f} MiB, serving after {serving_s:.2f} s")
    print(
        f"node agent idle RSS on fake:dgx-h100 over {STARTS} starts: median {statistics.median(samples):.1f} MiB "
        f"(min {min(samples):.1f}, max {max(samples):.1f})"
    )
