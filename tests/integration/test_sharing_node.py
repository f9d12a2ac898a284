"""TimeSlicing and MPS applied at prepare, undone at unprepare, rolled back after a crash and adopted after a
restart: the claim preparer with the real sharing code running the fake nvidia-smi / nvidia-cuda-mps-control
from a fake driver root, on the fake GPUs of a FAKE_NVML_STATE file (machine mixed-mig: GPUs 0-1 in MIG mode,
GPUs 2-3 whole)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

import fakes.apiserver
import fakes.nvml as fake_nvml
from agent.claims import cdi
from agent.claims.checkpoint import CheckpointStore
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.sharing import ClaimSharing
from agent.claims.types import ClaimRef
from agent.devices.model import ComputeMode, Inventory
from agent.nvml.source import NvmlSource, open_nvml
from agent.sharing.commands import DriverRoot, SubprocessRunner
from agent.sharing.control import SharingControl
from agent.sharing.plan import SharedDevice
from fakes.kubelet import FakeKubelet
from fakes.nvml import persist
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.mps import PID_FILE
from tests.claim_sources import FileClaimSource
from tests.integration.test_node_support import Daemon, create_node, running, short_tmpdir
from tests.unit.test_claims_support import DRIVER, NODE, cdi_validator, claim, opaque

MPS_50 = {
    "strategy": "MPS",
    "mpsConfig": {
        "defaultActiveThreadPercentage": 50,
        "defaultPinnedDeviceMemoryLimit": "10Gi",
        "defaultPerDevicePinnedMemoryLimit": {"1": "4Gi"},
    },
}
MPS_HALF = {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}


def time_slicing(interval: str) -> dict[str, Any]:
    return {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}}


class Node:
    """One node's claim side with sharing, restartable (a new preparer over the same directories)."""

    def __init__(self, root: pathlib.Path, nvml: NvmlSource) -> None:
        self.root = root
        self.nvml = nvml
        self.driver_root = install_driver_root(root / "driver-root").parents[1]
        self.state_dir, self.cdi_root, self.claims = root / "state", root / "cdi", root / "claims"
        self.inventory = nvml.discover()
        self.preparer = self.restart()

    def restart(self) -> ClaimPreparer:
        """A new agent process: a fresh preparer that recovers (rolls back, adopts) as the node daemon does."""
        self.preparer = ClaimPreparer(
            PrepareSettings(
                node_name=NODE,
                driver_name=DRIVER,
                inventory=lambda: self.inventory,
                mig_caps=cdi.MigCaps(lambda: None),
                sharing=ClaimSharing(self.control()),
            ),
            state_dir=self.state_dir,
            cdi_root=self.cdi_root,
            source=FileClaimSource(self.claims),
            boot_id=lambda: "boot-1",
        )
        self.preparer.recover()
        return self.preparer

    def control(self) -> SharingControl:
        return SharingControl(SubprocessRunner(DriverRoot(self.driver_root)), self.state_dir)

    def add_claim(self, uid: str, devices: list[str], sharing: dict[str, Any], kind: str = "GpuConfig") -> ClaimRef:
        ref = ClaimRef("default", uid, f"claim-{uid}")
        body = claim(uid, devices, name=ref.name, configs=[opaque(kind, sharing=sharing)])
        (self.claims / "default").mkdir(parents=True, exist_ok=True)
        (self.claims / "default" / f"{ref.name}.json").write_text(json.dumps(body))
        return ref

    def gpus(self) -> Inventory:
        return self.nvml.discover()

    def gpu(self, minor: int) -> Any:
        return next(g for g in self.gpus().gpus if g.minor == minor)

    def fake_gpu(self, minor: int) -> Any:
        fake = fake_nvml.installed()
        assert fake is not None
        return next(g for g in fake.gpus if g.minor == minor)

    def pipe(self, uid: str) -> pathlib.Path:
        return self.state_dir / "mps" / uid / "pipe"

    def daemon_pid(self, uid: str) -> int:
        return int((self.pipe(uid) / PID_FILE).read_text())

    def ask_daemon(self, uid: str, *commands: str) -> list[str]:
        """Ask the claim's MPS daemon as a CUDA client in a container would: through its pipe directory."""
        env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe(uid))}
        done = subprocess.run(
            [str(self.driver_root / "usr/bin/nvidia-cuda-mps-control")],
            text=True,
            env=env,
            input="".join(c + "\n" for c in commands),
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    def mig_names(self, parent_minor: int) -> list[str]:
        return [m.name for m in self.inventory.mig_devices_of(parent_minor)]


@pytest.fixture
def node(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    monkeypatch.setenv(persist.ENV, str(tmp_path / "gpus.json"))
    with open_nvml("fake:mixed-mig") as nvml:
        yield Node(tmp_path, nvml)
    for pid_file in tmp_path.rglob(PID_FILE):  # leave no daemon behind a failed test
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] == "Z":
                return True
        except (ProcessLookupError, FileNotFoundError):
            return True
        time.sleep(0.02)
    return False


def test_time_slicing_is_set_at_prepare_and_restored_after_the_last_claim(node: Node) -> None:
    first = node.add_claim("ts-1", ["gpu-2"], time_slicing("Long"))
    second = node.add_claim("ts-2", ["gpu-2"], time_slicing("Long"))  # same strategy: may share the GPU
    results = node.preparer.prepare([first, second])
    assert {uid: r.error for uid, r in results.items()} == {"ts-1": "", "ts-2": ""}
    assert (node.fake_gpu(2).timeslice, node.fake_gpu(3).timeslice) == (3, 0)
    assert node.preparer.unprepare([first]) == {"ts-1": ""}
    assert node.fake_gpu(2).timeslice == 3  # the other claim still time-slices it
    assert node.preparer.unprepare([second]) == {"ts-2": ""}
    assert node.fake_gpu(2).timeslice == 0
    assert list((node.state_dir / "sharing").iterdir()) == []


def test_a_mig_device_configured_for_time_slicing_is_prepared_without_a_time_slice_and_the_user_told(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    # Tried: MigDeviceConfig with strategy TimeSlicing (NVIDIA's driver accepts it and sets no time slice). Before,
    # its prepare failed ("MIG devices cannot be time-sliced") and the pod stayed in ContainerCreating.
    told: list[tuple[ClaimRef | None, str, str, str]] = []
    node.preparer.notify = lambda *event: told.append(event)
    mig = node.mig_names(0)[0]
    ts_mig = node.add_claim("ts-mig", [mig], {"strategy": "TimeSlicing"}, kind="MigDeviceConfig")
    ts_gpu = node.add_claim("ts-gpu", ["gpu-3"], time_slicing("Short"))
    with caplog.at_level("INFO", logger="agent.claims.preparer"):
        results = node.preparer.prepare([ts_mig, ts_gpu])
    assert {uid: r.error for uid, r in results.items()} == {"ts-mig": "", "ts-gpu": ""}
    assert (node.fake_gpu(0).timeslice, node.fake_gpu(3).timeslice) == (0, 1)  # the MIG device's GPU: untouched
    assert told == [
        (
            ts_mig,
            "Normal",
            "MigTimeSliceNotSet",
            f"MIG device(s) {mig} are shared by time as configured, but a MIG device's time slice cannot "
            "be set: processes on it take turns at the driver's default time slice",
        )
    ]
    # one line per claim prepared: the claim, its devices and how long the call took
    lines = [r for r in caplog.records if r.getMessage().startswith("prepared claim")]
    assert [(r.claim_uid, r.devices) for r in lines] == [("ts-mig", [mig]), ("ts-gpu", ["gpu-3"])]  # type: ignore[attr-defined]
    assert lines[0].getMessage().startswith(f"prepared claim default/claim-ts-mig (uid ts-mig): {mig} in ")
    second = node.add_claim("ts-mig-2", [mig], {"strategy": "TimeSlicing"}, kind="MigDeviceConfig")
    assert node.preparer.prepare([second])["ts-mig-2"].error == ""  # the same strategy: they share the device
    with caplog.at_level("INFO", logger="agent.claims.preparer"):
        assert node.preparer.unprepare([ts_mig, second, ts_gpu]) == {"ts-mig": "", "ts-mig-2": "", "ts-gpu": ""}
    assert [r.getMessage().split(":")[0] for r in caplog.records if r.getMessage().startswith("unprepared")] == [
        "unprepared claim default/claim-ts-mig (uid ts-mig)",
        "unprepared claim default/claim-ts-mig-2 (uid ts-mig-2)",
        "unprepared claim default/claim-ts-gpu (uid ts-gpu)",
    ]
    assert node.fake_gpu(3).timeslice == 0
    assert list((node.state_dir / "sharing").iterdir()) == []


def test_mps_claim_gets_its_daemon_exclusive_gpus_limits_and_cdi_edits(node: Node, shared_dir: pathlib.Path) -> None:
    ref = node.add_claim("mps-1", ["gpu-2", "gpu-3"], MPS_50)  # 10Gi on the first, 4Gi on device 1
    t0 = time.monotonic()
    assert node.preparer.prepare([ref])["mps-1"].error == ""
    prepare_s = time.monotonic() - t0
    uuids = [node.gpu(2).uuid, node.gpu(3).uuid]
    # What discovery (and `inventory`) now reports for both GPUs.
    for minor in (2, 3):
        assert (node.gpu(minor).compute_mode, node.gpu(minor).mps_server) == (ComputeMode.EXCLUSIVE_PROCESS, True)
    assert (node.gpu(0).compute_mode, node.gpu(0).mps_server) == (ComputeMode.DEFAULT, False)
    # The daemon, asked through the claim's pipe directory: its limits are in force.
    pid = node.daemon_pid("mps-1")
    assert node.ask_daemon(
        "mps-1",
        "get_server_list",
        "get_default_active_thread_percentage",
        f"get_default_device_pinned_mem_limit {uuids[0]}",
        f"get_default_device_pinned_mem_limit {uuids[1]}",
    ) == [str(pid), "50.0", "10240M", "4096M"]
    assert (node.state_dir / "mps" / "mps-1" / "log" / "control.log").exists()
    # The containers of each MPS device get the pipe directory at NVIDIA's path, and /dev/shm (with that device,
    # not claim-wide); the spec stays valid CDI.
    spec = yaml.safe_load((node.cdi_root / cdi.spec_file_name("mps-1")).read_text())
    for edits in (d["containerEdits"] for d in spec["devices"]):
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
        assert {(m["hostPath"], m["containerPath"]) for m in edits["mounts"]} == {
            (str(node.pipe("mps-1")), "/tmp/nvidia-mps"),
            ("/dev/shm", "/dev/shm"),
        }
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" not in spec["containerEdits"]["env"]
    assert list(cdi_validator(shared_dir).iter_errors(spec)) == []
    # Unprepare: quit, GPUs back to DEFAULT, directories gone.
    assert node.preparer.unprepare([ref]) == {"mps-1": ""}
    assert wait_gone(pid)
    assert all((node.gpu(m).compute_mode, node.gpu(m).mps_server) == (ComputeMode.DEFAULT, False) for m in (2, 3))
    assert not (node.state_dir / "mps" / "mps-1").exists()
    print(f"MPS prepare (2 GPUs, fake binaries): {prepare_s:.2f}s")


def test_a_second_mps_claim_on_a_served_gpu_is_refused(node: Node) -> None:
    first = node.add_claim("mps-a", ["gpu-2"], MPS_HALF)
    second = node.add_claim("mps-b", ["gpu-2"], {"strategy": "MPS"})
    assert node.preparer.prepare([first])["mps-a"].error == ""
    error = node.preparer.prepare([second])["mps-b"].error
    assert error.startswith("cannot apply the sharing of claim mps-b: device GPU-")
    assert "is already served by the MPS daemon of claim mps-a" in error
    assert node.ask_daemon("mps-a", "get_default_active_thread_percentage") == ["50.0"]  # untouched
    assert node.gpu(2).compute_mode is ComputeMode.EXCLUSIVE_PROCESS
    assert not (node.state_dir / "mps" / "mps-b").exists()


def test_mps_on_a_mig_device_leaves_the_parent_compute_mode_alone(node: Node) -> None:
    mig = node.mig_names(1)[0]
    uuid = next(m.uuid for m in node.inventory.mig_devices if m.name == mig)
    ref = node.add_claim(
        "mps-mig",
        [mig],
        {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "2Gi"}},
        kind="MigDeviceConfig",
    )
    assert node.preparer.prepare([ref])["mps-mig"].error == ""
    assert node.ask_daemon("mps-mig", f"get_default_device_pinned_mem_limit {uuid}") == ["2048M"]
    parent = node.gpu(1)
    assert (parent.compute_mode, parent.mps_server) == (ComputeMode.DEFAULT, True)
    assert node.preparer.unprepare([ref]) == {"mps-mig": ""}


def test_a_restarted_agent_adopts_running_daemons_restarts_dead_ones_and_stops_orphans(node: Node) -> None:
    ref = node.add_claim("mps-keep", ["gpu-2"], MPS_HALF)
    assert node.preparer.prepare([ref])["mps-keep"].error == ""
    pid = node.daemon_pid("mps-keep")
    node.restart()  # the daemon outlived the agent: adopted as it is
    assert node.daemon_pid("mps-keep") == pid
    assert node.ask_daemon("mps-keep", "get_server_list") == [str(pid)]

    os.kill(pid, signal.SIGKILL)  # the daemon dies while the agent is down
    assert wait_gone(pid)
    node.restart()
    new_pid = node.daemon_pid("mps-keep")
    assert new_pid != pid
    assert node.ask_daemon("mps-keep", "get_default_active_thread_percentage") == ["50.0"]  # limits re-applied

    # A daemon of a claim the checkpoint does not hold (its agent died before recording it): stopped.
    orphan = node.control().apply("orphan", [SharedDevice("gpu-3", node.gpu(3).uuid, node.gpu(3).uuid, _mps_config())])
    assert orphan is not None
    orphan_pid = node.daemon_pid("orphan")
    node.restart()
    assert wait_gone(orphan_pid)
    assert not (node.state_dir / "mps" / "orphan").exists()
    assert node.gpu(3).compute_mode is ComputeMode.DEFAULT
    assert node.ask_daemon("mps-keep", "get_server_list") == [str(new_pid)]  # the prepared claim's stays
    assert node.preparer.unprepare([ref]) == {"mps-keep": ""}


def test_a_crash_between_starting_the_daemon_and_recording_the_claim_is_rolled_back_then_redone(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = node.add_claim("mps-crash", ["gpu-3"], MPS_HALF)
    saves = {"n": 0}
    real_save = CheckpointStore.save

    def crash_on_completed_save(self: CheckpointStore, cp: Any) -> None:
        saves["n"] += 1
        if saves["n"] == 2:  # Started was saved, the daemon started; the Completed save never happens
            raise OSError("simulated crash")
        real_save(self, cp)

    monkeypatch.setattr(CheckpointStore, "save", crash_on_completed_save)
    assert node.preparer.prepare([ref])["mps-crash"].error.startswith("cannot prepare")
    pid = node.daemon_pid("mps-crash")
    assert node.gpu(3).compute_mode is ComputeMode.EXCLUSIVE_PROCESS
    monkeypatch.setattr(CheckpointStore, "save", real_save)

    node.restart()  # recover: the Started claim is rolled back with its sharing
    assert wait_gone(pid)
    assert node.gpu(3).compute_mode is ComputeMode.DEFAULT
    assert not (node.state_dir / "sharing" / "mps-crash.json").exists()

    assert node.preparer.prepare([ref])["mps-crash"].error == ""  # the kubelet's retry redoes it
    assert node.ask_daemon("mps-crash", "get_default_active_thread_percentage") == ["50.0"]
    assert node.preparer.unprepare([ref]) == {"mps-crash": ""}


def test_a_missing_binary_is_that_claims_clear_error(node: Node) -> None:
    (node.driver_root / "usr/bin/nvidia-smi").unlink()
    ref = node.add_claim("ts-nobin", ["gpu-2"], time_slicing("Medium"))
    error = node.preparer.prepare([ref])["ts-nobin"].error
    assert error.startswith("cannot apply the sharing of claim ts-nobin: nvidia-smi not found under driver root")
    assert str(node.driver_root / "usr/bin") in error
    plain = ClaimRef("default", "plain", "claim-plain")  # a claim without sharing needs no binary
    (node.claims / "default" / "claim-plain.json").write_text(json.dumps(claim("plain", ["gpu-3"], name=plain.name)))
    assert node.preparer.prepare([plain])["plain"].error == ""


def test_a_failed_mps_prepare_leaves_nothing_that_blocks_the_gpu(node: Node) -> None:
    """nvidia-smi missing: the MPS claim fails with a clear error and nothing stays behind (no record, no
    daemon directories, no checkpoint entry), so its unprepare, another claim of the GPU and a restart all
    work; with the binary back the same claim prepares."""
    smi = node.driver_root / "usr/bin/nvidia-smi"
    saved = smi.read_bytes()
    smi.unlink()
    ref = node.add_claim("mps-nobin", ["gpu-2"], MPS_HALF)
    error = node.preparer.prepare([ref])["mps-nobin"].error
    assert error.startswith("cannot apply the sharing of claim mps-nobin: nvidia-smi not found under driver root")
    assert "cannot undo" not in error
    assert not (node.state_dir / "sharing" / "mps-nobin.json").exists()
    assert not (node.state_dir / "mps" / "mps-nobin").exists()
    assert node.preparer.unprepare([ref]) == {"mps-nobin": ""}
    plain = ClaimRef("default", "plain", "claim-plain")
    (node.claims / "default" / "claim-plain.json").write_text(json.dumps(claim("plain", ["gpu-2"], name=plain.name)))
    assert node.preparer.prepare([plain])["plain"].error == ""  # the GPU is not held by the failed claim
    assert node.preparer.unprepare([plain]) == {"plain": ""}
    node.restart()
    smi.write_bytes(saved)
    smi.chmod(0o755)
    assert node.preparer.prepare([ref])["mps-nobin"].error == ""
    assert node.gpu(2).compute_mode is ComputeMode.EXCLUSIVE_PROCESS
    assert node.preparer.unprepare([ref]) == {"mps-nobin": ""}
    assert node.gpu(2).compute_mode is ComputeMode.DEFAULT


def test_a_failed_daemon_start_undoes_the_compute_mode_it_set(node: Node) -> None:
    """nvidia-cuda-mps-control missing: the GPU had been set to EXCLUSIVE_PROCESS; the failed prepare puts
    it back to DEFAULT and leaves no record."""
    (node.driver_root / "usr/bin/nvidia-cuda-mps-control").unlink()
    ref = node.add_claim("mps-nod", ["gpu-3"], MPS_HALF)
    error = node.preparer.prepare([ref])["mps-nod"].error
    assert "nvidia-cuda-mps-control not found under driver root" in error and "cannot undo" not in error
    assert node.gpu(3).compute_mode is ComputeMode.DEFAULT
    assert not (node.state_dir / "sharing" / "mps-nod.json").exists()
    assert not (node.state_dir / "mps" / "mps-nod").exists()
    assert node.preparer.unprepare([ref]) == {"mps-nod": ""}


def test_undoing_a_record_of_nothing_applied_needs_no_binary(node: Node, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kill -9 right after the record was written, before any change: the restarted agent, with no
    NVIDIA binary at all, rolls the claim back and the GPU is free."""
    ref = node.add_claim("mps-early", ["gpu-2"], MPS_HALF)

    class Killed(BaseException):
        """Ends the prepare as kill -9 would: no handler of the agent runs."""

    def killed(*args: Any, **kwargs: Any) -> None:
        raise Killed

    monkeypatch.setattr(SharingControl, "_step", killed)
    with pytest.raises(Killed):
        node.preparer.prepare([ref])
    monkeypatch.undo()
    assert (node.state_dir / "sharing" / "mps-early.json").exists()
    for binary in ("nvidia-smi", "nvidia-cuda-mps-control"):
        (node.driver_root / "usr/bin" / binary).unlink()
    node.restart()
    assert not (node.state_dir / "sharing" / "mps-early.json").exists()
    assert node.preparer.unprepare([ref]) == {"mps-early": ""}
    assert node.gpu(2).compute_mode is ComputeMode.DEFAULT


def test_a_dead_mps_daemon_is_started_again_by_the_watch_and_by_a_re_prepare(node: Node) -> None:
    ref = node.add_claim("mps-watch", ["gpu-2"], MPS_HALF)
    assert node.preparer.prepare([ref])["mps-watch"].error == ""
    assert node.preparer.revive_dead_daemons() == []  # alive: nothing to do
    pid = node.daemon_pid("mps-watch")
    os.kill(pid, signal.SIGKILL)  # dies while the agent runs
    assert wait_gone(pid)
    [revival] = node.preparer.revive_dead_daemons()
    new_pid = node.daemon_pid("mps-watch")
    assert (revival.uid, revival.name, revival.old_pid, revival.new_pid, revival.error) == (
        "mps-watch",
        "claim-mps-watch",
        pid,
        new_pid,
        "",
    )
    assert new_pid != pid
    assert node.ask_daemon("mps-watch", "get_default_active_thread_percentage") == ["50.0"]  # limits again
    assert node.gpu(2).compute_mode is ComputeMode.EXCLUSIVE_PROCESS

    os.kill(new_pid, signal.SIGKILL)
    assert wait_gone(new_pid)
    assert node.preparer.prepare([ref])["mps-watch"].error == ""  # a re-prepare checks the daemon too
    third = node.daemon_pid("mps-watch")
    assert third not in (pid, new_pid)
    assert node.ask_daemon("mps-watch", "get_server_list") == [str(third)]

    # A daemon that cannot be started again fails the re-prepare and is reported by the watch.
    os.kill(third, signal.SIGKILL)
    assert wait_gone(third)
    (node.driver_root / "usr/bin/nvidia-cuda-mps-control").unlink()
    error = node.preparer.prepare([ref])["mps-watch"].error
    assert error.startswith(
        "the MPS control daemon of claim mps-watch is gone and cannot be started again: "
        "nvidia-cuda-mps-control not found"
    )
    [failed] = node.preparer.revive_dead_daemons()
    assert failed.error == error and failed.new_pid is None


def test_the_watch_leaves_the_daemon_of_an_unprepared_claim_stopped(node: Node) -> None:
    ref = node.add_claim("mps-gone", ["gpu-3"], MPS_HALF)
    assert node.preparer.prepare([ref])["mps-gone"].error == ""
    pid = node.daemon_pid("mps-gone")
    assert node.preparer.unprepare([ref]) == {"mps-gone": ""}
    assert wait_gone(pid)
    assert node.preparer.revive_dead_daemons() == []
    assert not (node.state_dir / "mps" / "mps-gone").exists()


def test_the_node_daemon_killed_with_9_finds_its_mps_daemon_again(tmp_path: pathlib.Path) -> None:
    """The real `gpu-dra-agent node` process, prepared through the kubelet's sockets: an MPS claim's daemon
    survives kill -9 of the agent, is adopted by the restarted agent (same pid), and stops at unprepare."""
    with short_tmpdir("mps-node-") as root, fakes.apiserver.start(port=0) as server:
        api = server.api_client()
        create_node(api)
        ref = allocate_with_config(api, "mps-claim", ["gpu-5"], opaque(sharing=MPS_HALF))
        state = root / "gpus.json"
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"), env={persist.ENV: str(state)})
        driver_root = install_driver_root(root / "driver-root").parents[1]
        daemon.extra_args = ("--driver-root", str(driver_root))
        pipe = daemon.state_dir / "mps" / ref.uid / "pipe"
        try:
            with FakeKubelet(daemon.kubelet_root, timeout=30) as kubelet:
                with running(daemon):
                    kubelet.wait_for_driver(DRIVER)
                    assert kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""
                    pid = int((pipe / PID_FILE).read_text())
                    daemon.kill()
                gpus = fake_nvml.FakeNvml(fake_nvml.MACHINES["dgx-h100"], state).gpus
                assert (gpus[5].compute_mode, [p.pid for p in gpus[5].processes]) == (3, [pid])  # still serving
                with running(daemon):
                    record = daemon.wait_for_log("sharing reconciled")
                    assert (record["mps_adopted"], record["mps_restarted"]) == ([ref.uid], [])
                    kubelet.wait_for_driver(DRIVER)
                    assert int((pipe / PID_FILE).read_text()) == pid
                    assert kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""  # idempotent: same daemon
                    assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
                    assert wait_gone(pid)
                    assert daemon.terminate() == 0
            gpus = fake_nvml.FakeNvml(fake_nvml.MACHINES["dgx-h100"], state).gpus
            assert (gpus[5].compute_mode, gpus[5].processes) == (0, [])
            assert not pipe.exists()
        finally:
            for pid_file in root.rglob(PID_FILE):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_the_node_daemon_restarts_a_dead_mps_daemon_with_an_event_on_the_claim() -> None:
    with short_tmpdir("mps-watch-") as root, fakes.apiserver.start(port=0) as server:
        api = server.api_client()
        create_node(api)
        ref = allocate_with_config(api, "mps-watched", ["gpu-6"], opaque(sharing=MPS_HALF))
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"), env={persist.ENV: str(root / "gpus.json")})
        pipe = daemon.state_dir / "mps" / ref.uid / "pipe"
        try:
            with FakeKubelet(daemon.kubelet_root, timeout=30) as kubelet, running(daemon):
                kubelet.wait_for_driver(DRIVER)
                assert kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""
                pid = int((pipe / PID_FILE).read_text())
                os.kill(pid, signal.SIGKILL)
                assert wait_gone(pid)
                deadline = time.monotonic() + 20
                while not (events := [e for e in server.store.objects("Event") if e["reason"] == "MpsDaemonRestarted"]):
                    assert time.monotonic() < deadline, daemon.tail()
                    time.sleep(0.05)
                [event] = events
                new_pid = int((pipe / PID_FILE).read_text())
                assert event["type"] == "Warning"
                assert event["involvedObject"] == {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "name": "mps-watched",
                    "namespace": "default",
                    "uid": ref.uid,
                }
                assert event["message"] == (
                    f"the MPS control daemon of this claim (pid {pid}) was gone; started it again (pid {new_pid})"
                )
                assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
                assert wait_gone(new_pid)
        finally:
            for pid_file in root.rglob(PID_FILE):
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_the_node_daemon_tells_a_mig_time_slicing_claim_in_a_normal_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # Tried: the gpu-test shape with a MigDeviceConfig TimeSlicing claim, through the kubelet's gRPC and the daemon.
    with short_tmpdir("mig-ts-") as root, fakes.apiserver.start(port=0) as server:
        monkeypatch.setenv(persist.ENV, str(root / "gpus.json"))
        with open_nvml("fake:mixed-mig") as nvml:
            mig = nvml.discover().mig_devices_of(0)[0].name
        api = server.api_client()
        create_node(api)
        config = opaque("MigDeviceConfig", sharing={"strategy": "TimeSlicing"})
        ref = allocate_with_config(api, "mig-ts", [mig], config)
        daemon = Daemon(
            root,
            server.write_kubeconfig(root / "kubeconfig"),
            machine="fake:mixed-mig",
            env={persist.ENV: str(root / "gpus.json")},
        )
        with FakeKubelet(daemon.kubelet_root, timeout=30) as kubelet, running(daemon):
            kubelet.wait_for_driver(DRIVER)
            assert kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""
            deadline = time.monotonic() + 20
            while not (events := [e for e in server.store.objects("Event") if e["reason"] == "MigTimeSliceNotSet"]):
                assert time.monotonic() < deadline, daemon.tail()
                time.sleep(0.05)
            [event] = events
            assert (event["type"], event["involvedObject"]["kind"], event["involvedObject"]["uid"]) == (
                "Normal",
                "ResourceClaim",
                ref.uid,
            )
            assert "a MIG device's time slice cannot be set" in event["message"]
            assert kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}


def allocate_with_config(api: Any, name: str, devices: list[str], config: dict[str, Any]) -> ClaimRef:
    """A claim for `devices` allocated (as the scheduler writes it) with one opaque config of this driver."""
    resource = client.ResourceV1Api(api)
    created = resource.create_namespaced_resource_claim(
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [
                        {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": len(devices)}}
                    ]
                }
            },
        },
    )
    body = api.sanitize_for_serialization(created)
    body["status"] = {
        "allocation": {
            "devices": {
                "results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": d} for d in devices],
                "config": [config],
            },
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
            },
        }
    }
    resource.replace_namespaced_resource_claim_status(name, "default", body)
    return ClaimRef("default", created.metadata.uid, name)


def _mps_config() -> Any:
    from agent.claimconfig.config import GPU_CONFIG, DeviceConfig, Mps

    return DeviceConfig(GPU_CONFIG, Mps(active_thread_percentage=10))
