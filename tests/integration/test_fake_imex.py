"""The fake nvidia-imex and nvidia-imex-ctl as executables in a fake driver root: the daemon records the nodes it
loaded, reloads them on SIGUSR1, and the control tool answers `-q` as NVIDIA's compute-domain daemon reads it."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import time

import pynvml as N

import fakes.nvml as fake_nvml
from fakes.computedomains import wait_for
from fakes.nvml import persist
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.imex import status_path
from fakes.nvml.machines import nvl72_node


def _config(tmp: pathlib.Path, nodes: list[str]) -> pathlib.Path:
    (tmp / "nodes.cfg").write_text("".join(f"{n}\n" for n in nodes))
    config = tmp / "imexd.cfg"
    config.write_text(
        f"DAEMONIZE=0\nSERVER_PORT=50000\nIMEX_NODE_CONFIG_FILE={tmp / 'nodes.cfg'}\n"
        "IMEX_CMD_BIND_INTERFACE_IP=127.0.0.3\nIMEX_CMD_PORT=50005\n"
    )
    return config


def test_daemon_records_its_nodes_and_ctl_answers_ready(tmp_path: pathlib.Path) -> None:
    bin_dir = install_driver_root(tmp_path / "root")
    state = tmp_path / "gpus.json"
    fake = fake_nvml.FakeNvml(nvl72_node(2), state)
    env = {**os.environ, persist.ENV: str(state)}
    config = _config(tmp_path, ["127.0.0.1", "127.0.0.2", "127.0.0.3"])

    def ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(bin_dir / "nvidia-imex-ctl"), "-c", str(config), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )

    assert ctl("-q").returncode == 1  # no daemon yet: the tool cannot reach it
    daemon = subprocess.Popen([str(bin_dir / "nvidia-imex"), "-c", str(config)], env=env, stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: ctl("-q").stdout == "READY\n", timeout=30, what="the fake daemon to be ready")
        loaded = json.loads(status_path(config).read_text())
        assert loaded["nodes"] == ["127.0.0.1", "127.0.0.2", "127.0.0.3"] and loaded["pid"] == daemon.pid
        assert "Node #2 - 127.0.0.3 - READY" in ctl("-N").stdout

        fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_NOT_STARTED)  # the fabric breaks under the daemon
        assert ctl("-q").stdout == "UNAVAILABLE\n"
        fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_COMPLETED)

        (tmp_path / "nodes.cfg").write_text("127.0.0.3\n127.0.0.4\n")
        daemon.send_signal(signal.SIGUSR1)
        wait_for(
            lambda: json.loads(status_path(config).read_text())["nodes"] == ["127.0.0.3", "127.0.0.4"],
            timeout=30,
            what="the reload",
        )
    finally:
        daemon.terminate()
        assert daemon.wait(timeout=30) == 0
    assert not status_path(config).exists()
    assert ctl("-q").returncode == 1


def test_daemon_refuses_a_peer_off_loopback(tmp_path: pathlib.Path) -> None:
    bin_dir = install_driver_root(tmp_path / "root")
    config = _config(tmp_path, ["127.0.0.1", "10.0.0.7"])
    started = time.monotonic()
    done = subprocess.run(
        [str(bin_dir / "nvidia-imex"), "-c", str(config)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1 and "10.0.0.7 is not a loopback address" in done.stderr
    assert time.monotonic() - started < 30


def test_a_daemon_left_without_its_pid_file_is_still_found_and_stopped(tmp_path: pathlib.Path) -> None:
    """Tried: an agent killed between starting nvidia-imex and writing its pid file. The next agent's clean-up finds
    the daemon by its config path (found by the 50-trial kill -9 run, seed 3636625032)."""
    from agent.computedomain.daemon import stop_leftovers

    bin_dir = install_driver_root(tmp_path / "root")
    domain_dir = tmp_path / "domains" / "uid-1"
    domain_dir.mkdir(parents=True)
    config = _config(domain_dir, ["127.0.0.1"])
    daemon = subprocess.Popen([str(bin_dir / "nvidia-imex"), "-c", str(config)], stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: status_path(config).exists(), timeout=30, what="the daemon to start")
        assert not (domain_dir / "imex.pid").exists()
        assert stop_leftovers(tmp_path / "domains") == ["uid-1"]
        assert daemon.wait(timeout=10) == 0  # stopped with SIGTERM, as the real one is
        assert not domain_dir.exists()
    finally:
        daemon.kill()
        daemon.wait()
