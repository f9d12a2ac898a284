"""The fake nvidia-smi and nvidia-cuda-mps-control, run as executables on a fake driver root's usr/bin, acting
on the GPUs of FAKE_NVML_STATE (which an NVML user in another process sees change)."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator

import pynvml as N
import pytest

import fakes.nvml as fake_nvml
from fakes.nvml import persist
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.mps import PID_FILE


class Binaries:
    def __init__(self, tmp: pathlib.Path) -> None:
        self.state = tmp / "gpus.json"
        self.fake = fake_nvml.FakeNvml(fake_nvml.MACHINES["mixed-mig"], self.state)  # creates the state
        self.bin = install_driver_root(tmp / "driver-root")
        self.pipe, self.log = tmp / "mps" / "pipe", tmp / "mps" / "log"

    def run(self, binary: str, *args: str, stdin: str = "", **env: str) -> subprocess.CompletedProcess[str]:
        full_env = {
            **os.environ,
            persist.ENV: str(self.state),
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log),
            **env,
        }
        return subprocess.run(
            [str(self.bin / binary), *args],
            input=stdin,
            text=True,
            capture_output=True,
            env=full_env,
            timeout=60,
            check=False,
        )

    def mps(self, *commands: str) -> subprocess.CompletedProcess[str]:
        return self.run("nvidia-cuda-mps-control", stdin="".join(c + "\n" for c in commands))


@pytest.fixture
def bins(tmp_path: pathlib.Path) -> Iterator[Binaries]:
    b = Binaries(tmp_path)
    yield b
    for pid_file in tmp_path.rglob(PID_FILE):  # a daemon a failed test left running
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_list_names_gpus_and_mig_devices_as_nvidia_smi_does(bins: Binaries) -> None:
    done = bins.run("nvidia-smi", "-L")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == f"GPU 0: NVIDIA H100 80GB HBM3 (UUID: {bins.fake.gpus[0].uuid})"
    mig_uuid = bins.fake.gpus[0].mig_devices()[0].uuid
    assert any(line.startswith("  MIG ") and line.endswith(f"(UUID: {mig_uuid})") for line in lines)


def test_compute_mode_and_time_slice_change_the_gpu_for_every_process(bins: Binaries) -> None:
    uuid = bins.fake.gpus[2].uuid
    done = bins.run("nvidia-smi", "-i", uuid, "-c", "EXCLUSIVE_PROCESS")
    assert done.returncode == 0, done.stderr
    assert "Compute mode set to EXCLUSIVE_PROCESS for GPU 00000000:9A:00.0" in done.stdout
    assert bins.run("nvidia-smi", "compute-policy", "-i", uuid, "--set-timeslice=3").returncode == 0
    with fake_nvml.install("mixed-mig", bins.state):  # an NVML user elsewhere sees it
        N.nvmlInit()
        assert N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByIndex(2)) == N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
        N.nvmlShutdown()
    assert bins.fake.gpus[2].timeslice == 3
    assert bins.run("nvidia-smi", "-i", "2", "-c", "DEFAULT").returncode == 0  # by index too
    assert bins.fake.gpus[2].compute_mode == N.NVML_COMPUTEMODE_DEFAULT


@pytest.mark.parametrize(
    ("args", "code", "said"),
    [
        pytest.param(["-i", "GPU-nope", "-c", "DEFAULT"], 6, "No devices were found", id="unknown-gpu"),
        pytest.param(["-i", "0", "-c", "SHARED"], 2, "Invalid compute mode", id="bad-mode"),
        pytest.param(["compute-policy", "-i", "0", "--set-timeslice=7"], 2, "Invalid timeslice", id="bad-slice"),
        pytest.param(["compute-policy", "-i", "MIG", "--set-timeslice=1"], 3, "MIG device", id="mig-slice"),
        pytest.param(["-i", "MIG", "-c", "EXCLUSIVE_PROCESS"], 3, "MIG device", id="mig-mode"),
        pytest.param(["--query-gpu=name"], 2, "unsupported", id="unsupported"),
    ],
)
def test_nvidia_smi_refuses_what_the_real_one_refuses(bins: Binaries, args: list[str], code: int, said: str) -> None:
    mig_uuid = bins.fake.gpus[0].mig_devices()[0].uuid
    done = bins.run("nvidia-smi", *[mig_uuid if a == "MIG" else a for a in args])
    assert done.returncode == code
    assert said in done.stdout + done.stderr
    assert all(g.compute_mode == 0 and g.timeslice == 0 for g in bins.fake.gpus)  # nothing changed


def test_a_lost_gpu_and_a_missing_driver_are_reported(bins: Binaries) -> None:
    bins.fake.lose_gpu(3)
    done = bins.run("nvidia-smi", "-i", "3", "-c", "EXCLUSIVE_PROCESS")
    assert (done.returncode, "GPU is lost" in done.stdout) == (15, True)
    done = bins.run("nvidia-smi", "-L", FAKE_NVML_STATE="")
    assert done.returncode == 9 and "couldn't communicate with the NVIDIA driver" in done.stdout


def test_mps_daemon_serves_its_pipe_directory_until_quit(bins: Binaries) -> None:
    uuid = bins.fake.gpus[2].uuid
    started = time.monotonic()
    done = bins.run("nvidia-cuda-mps-control", "-d", CUDA_VISIBLE_DEVICES=uuid)
    assert done.returncode == 0, done.stderr
    pid = int((bins.pipe / PID_FILE).read_text())
    # The daemon is not the caller's child and outlives it; its server shows on the GPU it serves only.
    assert [p.name for p in bins.fake.gpus[2].processes] == ["nvidia-cuda-mps-server"]
    assert bins.fake.gpus[3].processes == []
    answers = bins.mps(
        "set_default_active_thread_percentage 25",
        f"set_default_device_pinned_mem_limit {uuid} 2048M",
        "get_default_active_thread_percentage",
        "get_default_device_pinned_mem_limit 0",
        "get_server_list",
    )
    assert answers.returncode == 0, answers.stderr
    assert answers.stdout.split() == ["25.0", "25.0", "2048M", str(pid)]
    second = bins.run("nvidia-cuda-mps-control", "-d", CUDA_VISIBLE_DEVICES=uuid)
    assert second.returncode == 1 and "already running" in second.stderr
    assert bins.mps("quit").returncode == 0
    deadline = time.monotonic() + 10
    while (bins.pipe / PID_FILE).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (bins.pipe / "control").exists()
    assert bins.fake.gpus[2].processes == []
    assert "Starting control daemon" in (bins.log / "control.log").read_text()
    print(f"daemon start to quit: {time.monotonic() - started:.2f}s")


def test_mps_client_errors(bins: Binaries) -> None:
    nobody = bins.mps("get_server_list")
    assert nobody.returncode == 1 and "Cannot find MPS control daemon" in nobody.stderr
    assert bins.run("nvidia-cuda-mps-control", "-d").returncode == 0  # every GPU when nothing is named
    try:
        assert all(any(p.name == "nvidia-cuda-mps-server" for p in g.processes) for g in bins.fake.gpus)
        for command, said in [
            ("set_default_active_thread_percentage 150", "must be in (0, 100]"),
            ("set_default_device_pinned_mem_limit 9 1G", "not one of the 4 visible"),
            ("set_default_device_pinned_mem_limit 0 lots", "want <n>[K|M|G|T]"),
            ("start_server -uid 0", "Unrecognized command"),
        ]:
            done = bins.mps(command)
            assert (done.returncode, said in done.stderr) == (1, True), (command, done.stderr)
    finally:
        bins.mps("quit")


def test_a_killed_daemon_leaves_the_gpus(bins: Binaries) -> None:
    assert bins.run("nvidia-cuda-mps-control", "-d", CUDA_VISIBLE_DEVICES="2").returncode == 0
    os.kill(int((bins.pipe / PID_FILE).read_text()), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while bins.fake.gpus[2].processes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bins.fake.gpus[2].processes == []
    # A new daemon takes over the pipe directory the killed one left.
    assert bins.run("nvidia-cuda-mps-control", "-d", CUDA_VISIBLE_DEVICES="2").returncode == 0
    assert bins.mps("quit").returncode == 0
