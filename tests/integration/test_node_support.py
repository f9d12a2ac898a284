"""Running the real `gpu-dra-agent node` daemon as a subprocess, and claims for it to prepare.

(Named test_node_* to stay inside the node-daemon area; it holds no tests itself.)
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kubernetes import client

from agent.claims.types import ClaimRef
from fakes.nvml.binaries import install_driver_root

REPO = pathlib.Path(__file__).resolve().parents[2]
DRIVER = "gpu.nvidia.com"
NODE = "node-a"
MACHINE = "fake:dgx-h100"
DGX_H100_GPUS = 8
# Settings the daemon would otherwise take from the environment of whoever runs the tests.
_DAEMON_ENV = (
    "NODE_NAME",
    "DRIVER_NAME",
    "NVML",
    "KUBECONFIG",
    "KUBELET_ROOT",
    "CDI_ROOT",
    "STATE_DIR",
    "METRICS_ADDR",
    "HEALTHCHECK_ADDR",
    "LOG_FORMAT",
    "PARTITIONABLE_DEVICES",
    "MIG_CONFIG_FILE",
    "MIG_RECONFIGURE",
    "FAKE_NVML_STATE",
    "NVIDIA_DRIVER_ROOT",
)


def eventually(check: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        time.sleep(0.02)


@contextmanager
def short_tmpdir(prefix: str, base: str = "/tmp") -> Iterator[pathlib.Path]:
    """A directory under /tmp: unix socket paths must stay under 108 bytes, pytest's tmp_path may not."""
    path = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def fake_driver_root(root: pathlib.Path) -> pathlib.Path:
    """A driver root holding the fake nvidia-smi and nvidia-cuda-mps-control, which the agent checks at start."""
    return install_driver_root(root / "driver-root").parents[1]


def agent_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "agent.cli", "node", *args]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DAEMON_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # the caller's too
    return env


class Daemon:
    """One `gpu-dra-agent node` process with its own directories under `root`; JSON logs go to a file."""

    def __init__(
        self,
        root: pathlib.Path,
        kubeconfig: pathlib.Path,
        node: str = NODE,
        env: dict[str, str] | None = None,
        extra_args: tuple[str, ...] = (),
        machine: str = MACHINE,
    ) -> None:
        self.root = root
        self.env = env or {}  # e.g. FAKE_NVML_STATE, so the fake GPUs outlive the process
        self.extra_args = extra_args
        self.machine = machine
        self.kubelet_root = root / "kubelet"
        self.cdi_root = root / "cdi"
        self.state_dir = root / "state"
        self.kubeconfig = kubeconfig
        self.node = node
        self.log_path = root / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def registration_socket(self) -> pathlib.Path:
        return self.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> pathlib.Path:
        return self.kubelet_root / "plugins" / DRIVER / "dra.sock"

    def start(self) -> Daemon:
        """Start the process (returns at once); the same directories are reused across restarts. Without a
        --driver-root of the test's own, the fake binaries' driver root under `root`."""
        driver_root = () if "--driver-root" in self.extra_args else ("--driver-root", str(fake_driver_root(self.root)))
        args = agent_command(
            "--node-name",
            self.node,
            "--nvml",
            self.machine,
            "--kubeconfig",
            str(self.kubeconfig),
            "--kubelet-root",
            str(self.kubelet_root),
            "--cdi-root",
            str(self.cdi_root),
            "--state-dir",
            str(self.state_dir),
            "--metrics-addr",
            "127.0.0.1:0",
            "--log-format",
            "json",
            *driver_root,
            *self.extra_args,
        )
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.started_at = time.perf_counter()
            self.proc = subprocess.Popen(args, stdout=log, stderr=log, env=clean_env() | self.env, cwd=REPO)
        return self

    def logs(self) -> list[dict[str, Any]]:
        """JSON log records of the current run (other lines, e.g. a traceback, are skipped)."""
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            lines = f.read().decode(errors="replace").splitlines()
        records = []
        for line in lines:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records

    def wait_for_log(self, msg: str, timeout: float = 30.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = next((r for r in self.logs() if r.get("msg") == msg), None)
            if found is not None:
                return found
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode} before {msg!r}:\n{self.tail()}")
            time.sleep(0.02)
        raise AssertionError(f"agent did not log {msg!r} within {timeout}s:\n{self.tail()}")

    def wait_serving(self, timeout: float = 30.0) -> None:
        self.wait_for_log("kubelet plugin serving", timeout)

    def metrics_url(self) -> str:
        return f"http://{self.wait_for_log('metrics serving')['address']}/metrics"

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self, timeout: float = 10.0) -> int:
        """SIGTERM, and its exit code once it has shut down; killed, and its log's tail said, past `timeout`."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running {timeout:g} s after SIGTERM; its log ends:\n{self.tail(40)}") from None

    def kill(self) -> None:
        """kill -9: no handler runs, sockets and any half-written state stay behind."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@contextmanager
def running(daemon: Daemon) -> Iterator[Daemon]:
    daemon.start()
    try:
        daemon.wait_serving()
        yield daemon
    finally:
        daemon.close()


def create_node(api: Any, name: str = NODE) -> None:
    client.CoreV1Api(api).create_node({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}})


def allocate_claim(api: Any, name: str, devices: list[str], pool: str = NODE, namespace: str = "default") -> ClaimRef:
    """Create a claim for `devices` and write its allocation as the scheduler would, via the status subresource."""
    resource = client.ResourceV1Api(api)
    requests = [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": len(devices)}}]
    created = resource.create_namespaced_resource_claim(
        namespace,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": requests}},
        },
    )
    body = api.sanitize_for_serialization(created)
    body["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": pool, "device": d} for d in devices]},
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}]
            },
        }
    }
    resource.replace_namespaced_resource_claim_status(name, namespace, body)
    return ClaimRef(namespace, created.metadata.uid, name)


def cdi_id(ref: ClaimRef, device: str) -> str:
    return f"k8s.gpu.nvidia.com/claim={ref.uid}-{device}"


def cdi_file(cdi_root: pathlib.Path, ref: ClaimRef) -> pathlib.Path:
    return cdi_root / f"k8s.gpu.nvidia.com-claim_{ref.uid}.json"
