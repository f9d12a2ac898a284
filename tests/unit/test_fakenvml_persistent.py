"""FAKE_NVML_STATE: fake GPUs whose state outlives the process and is shared between processes."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pynvml as N
import pytest

import fakes.nvml as fake_nvml
from fakes.nvml import persist

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def state(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "gpus.json"


@pytest.fixture
def nvml(state: pathlib.Path) -> Iterator[fake_nvml.FakeNvml]:
    with fake_nvml.install("dgx-h100", state) as fake:
        N.nvmlInit()
        yield fake
        N.nvmlShutdown()


def python(code: str, state: pathlib.Path, **kw: object) -> subprocess.Popen[str]:
    env = {**os.environ, persist.ENV: str(state)}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )  # type: ignore[call-overload]


def run_python(code: str, state: pathlib.Path) -> str:
    proc = python(code, state)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return out


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fakes.nvml", *args], cwd=REPO, text=True, capture_output=True, timeout=60, check=False
    )


MAKE_MIG = """
    import pynvml as N, fakes.nvml
    fakes.nvml.install("dgx-h100")  # the state file comes from FAKE_NVML_STATE
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    N.nvmlDeviceSetMigMode(h, 1)
    info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    for _ in range({count}):
        gi = N.nvmlDeviceCreateGpuInstance(h, info.id)
        ci = N.nvmlGpuInstanceCreateComputeInstance(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        uuid = N.nvmlDeviceGetUUID(N.nvmlComputeInstanceGetInfo(ci).device)
        print(uuid, flush=True)
        {after}
"""


def mig_uuids(gpu_index: int) -> set[str]:
    h = N.nvmlDeviceGetHandleByIndex(gpu_index)
    out = set()
    for i in range(N.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            out.add(N.nvmlDeviceGetUUID(N.nvmlDeviceGetMigDeviceHandleByIndex(h, i)))
        except N.NVMLError_NotFound:
            continue
    return out


def test_a_new_state_file_starts_from_the_machine_profile(state: pathlib.Path) -> None:
    with fake_nvml.install("mixed-mig", state) as fake:
        expected = {ci.uuid for ci in fake.gpus[0].mig_devices()}
    data = json.loads(state.read_text())
    assert data["machine"] == "mixed-mig"
    stored = {ci["uuid"] for gi in data["gpus"][0]["gpuInstances"] for ci in gi["computeInstances"]}
    assert stored == expected and len(expected) == 4


def test_mig_devices_made_by_another_process_are_seen_with_their_uuids(
    nvml: fake_nvml.FakeNvml, state: pathlib.Path
) -> None:
    assert N.nvmlDeviceGetMigMode(N.nvmlDeviceGetHandleByIndex(0)) == [0, 0]
    made = set(run_python(MAKE_MIG.format(count=3, after=""), state).split())
    assert len(made) == 3
    # This process was running all along; its next NVML calls see the other's work.
    assert N.nvmlDeviceGetMigMode(N.nvmlDeviceGetHandleByIndex(0)) == [1, 1]
    assert mig_uuids(0) == made


def test_a_process_killed_with_9_leaves_the_gpus_as_it_left_them(state: pathlib.Path) -> None:
    proc = python(MAKE_MIG.format(count=7, after="import time; time.sleep(0.05)"), state)
    assert proc.stdout is not None
    made = [proc.stdout.readline().strip() for _ in range(3)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    # What a restarted agent finds: every MIG device it saw created, same uuids, and a loadable file.
    with fake_nvml.install("dgx-h100", state):
        N.nvmlInit()
        found = mig_uuids(0)
        N.nvmlShutdown()
    assert set(made) <= found
    assert len(found) in range(3, 8)


def test_handles_stay_valid_while_another_process_changes_other_gpus(
    nvml: fake_nvml.FakeNvml, state: pathlib.Path
) -> None:
    h0 = N.nvmlDeviceGetHandleByIndex(0)
    N.nvmlDeviceSetMigMode(h0, 1)
    profile = N.nvmlDeviceGetGpuInstanceProfileInfo(h0, N.NVML_GPU_INSTANCE_PROFILE_3_SLICE)
    gi = N.nvmlDeviceCreateGpuInstance(h0, profile.id)
    run_python(
        """
        import pynvml as N, fakes.nvml
        fakes.nvml.install("dgx-h100"); N.nvmlInit()
        N.nvmlDeviceSetComputeMode(N.nvmlDeviceGetHandleByIndex(5), N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    """,
        state,
    )
    assert N.nvmlGpuInstanceGetInfo(gi).placement.size == 4  # the GI handle from before still works
    assert N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByIndex(5)) == N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


def test_a_reset_drops_instances_but_keeps_mig_mode_for_every_process(
    nvml: fake_nvml.FakeNvml, state: pathlib.Path
) -> None:
    run_python(MAKE_MIG.format(count=2, after=""), state)
    assert len(mig_uuids(0)) == 2
    result = cli("reset", "--state", str(state), "--gpu", "0")
    assert result.returncode == 0, result.stderr
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetMigMode(h) == [1, 1]
    assert mig_uuids(0) == set()
    again = fake_nvml.FakeNvml(fake_nvml.MACHINES["dgx-h100"], state)  # a fresh start reads the same
    assert again.gpus[0].mig_current == 1 and not again.gpus[0].gpu_instances


def test_xid_from_the_cli_reaches_the_event_wait_of_the_process_using_the_state(
    nvml: fake_nvml.FakeNvml, state: pathlib.Path
) -> None:
    h = N.nvmlDeviceGetHandleByIndex(2)
    events = N.nvmlEventSetCreate()
    N.nvmlDeviceRegisterEvents(h, N.nvmlEventTypeXidCriticalError, events)
    result = cli("xid", "--state", str(state), "--gpu", "2", "--xid", "48")
    assert result.returncode == 0, result.stderr
    data = N.nvmlEventSetWait_v2(events, 5000)
    assert (N.nvmlDeviceGetIndex(data.device), data.eventData) == (2, 48)
    # Delivered once: it left the file's queue.
    with pytest.raises(N.NVMLError_Timeout):
        N.nvmlEventSetWait_v2(events, 100)
    assert json.loads(state.read_text())["pendingEvents"] == []
    N.nvmlEventSetFree(events)


def test_an_xid_waits_in_the_state_until_an_agent_listens(state: pathlib.Path) -> None:
    assert cli("xid", "--state", str(state), "--machine", "dgx-h100", "--gpu", "4", "--xid", "79").returncode == 0
    with fake_nvml.install("dgx-h100", state):
        N.nvmlInit()
        events = N.nvmlEventSetCreate()
        N.nvmlDeviceRegisterEvents(N.nvmlDeviceGetHandleByIndex(4), N.nvmlEventTypeXidCriticalError, events)
        assert N.nvmlEventSetWait_v2(events, 2000).eventData == 79
        N.nvmlEventSetFree(events)
        N.nvmlShutdown()


def test_lose_makes_the_gpu_fall_off_the_bus_for_the_running_process(
    nvml: fake_nvml.FakeNvml, state: pathlib.Path
) -> None:
    h = N.nvmlDeviceGetHandleByIndex(6)
    result = cli("lose", "--state", str(state), "--gpu", "6")
    assert result.returncode == 0, result.stderr
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetUUID(h)
    with pytest.raises(N.NVMLError_GpuIsLost):
        N.nvmlDeviceGetHandleByIndex(6)
    N.nvmlDeviceGetHandleByIndex(5)  # the others are fine


def test_show_prints_modes_and_instance_tables(state: pathlib.Path) -> None:
    with fake_nvml.install("mixed-mig", state) as fake:
        N.nvmlInit()
        N.nvmlDeviceSetComputeMode(N.nvmlDeviceGetHandleByIndex(2), N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
        uuid = fake.gpus[0].mig_devices()[0].uuid
        N.nvmlShutdown()
    result = cli("show", "--state", str(state))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-" in out
    assert "MIG Mode: Enabled (pending: Enabled)" in out and "MIG Mode: Disabled (pending: Disabled)" in out
    assert "Compute Mode: Exclusive_Process" in out
    assert uuid in out
    assert "GPU instances:" in out and "Compute instances:" in out
    assert "MIG 3g.40gb" in out and "4:4" in out  # the 3g GI at placement 4, size 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["show"], "pass --machine", id="state-missing-without-machine"),
        pytest.param(
            ["xid", "--gpu", "9", "--xid", "48", "--machine", "dgx-h100"], "GPUs 0..7, not 9", id="gpu-out-of-range"
        ),
        pytest.param(["show", "--machine", "dgx-h999"], "unknown fake NVML machine", id="unknown-machine"),
    ],
)
def test_cli_refuses_bad_input_with_a_clear_error(state: pathlib.Path, args: list[str], message: str) -> None:
    result = cli(*args[:1], "--state", str(state), *args[1:])
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_a_state_of_another_machine_is_refused_and_kept(state: pathlib.Path) -> None:
    fake_nvml.install("dgx-h100", state)
    fake_nvml.uninstall()
    before = state.read_text()
    with pytest.raises(ValueError, match="holds machine 'dgx-h100', not 'hgx-h200'"):
        fake_nvml.install("hgx-h200", state)
    assert state.read_text() == before


def test_a_malformed_state_is_a_clear_error(state: pathlib.Path) -> None:
    state.write_text("{not json")
    with pytest.raises(persist.StateFileError, match="is not JSON"):
        fake_nvml.install("dgx-h100", state)


def test_processes_of_fake_binaries_leave_with_their_pid(nvml: fake_nvml.FakeNvml) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        nvml.set_processes(1, [(sleeper.pid, 1 << 20)], name="nvidia-cuda-mps-server", tracked=True)
        h = N.nvmlDeviceGetHandleByIndex(1)
        assert [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)] == [sleeper.pid]
    finally:
        sleeper.kill()
        sleeper.wait()
    deadline = time.monotonic() + 5
    while N.nvmlDeviceGetComputeRunningProcesses(h) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert N.nvmlDeviceGetComputeRunningProcesses(h) == []
