"""One demo node: the real `gpu-dra-agent node` as a subprocess on a fake NVML machine, and its fake kubelet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TypeVar

from agent.devices.names import GpuName, parse_device_name
from agent.kubelet.plugin import dra_socket_path, registration_socket_path
from agent.kubelet.sockets import MAX_SOCKET_PATH
from agent.sharing.mps import MPS_CONTROL
from agent.slices.build import DEFAULT_DRIVER
from fakes.kubelet import FakeKubelet, Plugin
from fakes.nvml import persist
from fakes.nvml.control import FakeNvml
from fakes.nvml.machines import get_machine
from fakes.nvml.show import COMPUTE_MODES, TIMESLICES

DRIVER = DEFAULT_DRIVER
T = TypeVar("T")


class DemoError(RuntimeError):
    """The demo cannot go on; the message says what a person should look at."""


class DemoNode:
    """Directories under `root`: kubelet/, cdi/, state/ and agent.log (unless the agent logs to our stderr)."""

    def __init__(
        self,
        name: str,
        machine: str,
        root: Path,
        kubeconfig: Path,
        *,
        driver_root: Path,
        verbose: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.machine = machine
        self.root = root
        self.kubelet_root = root / "kubelet"
        self.cdi_root = root / "cdi"
        self.state_dir = root / "state"
        self.log_path = root / "agent.log"
        self.gpu_state = root / "gpus.json"  # FAKE_NVML_STATE: the fake GPUs, shared with the fake binaries
        self.driver_root = driver_root  # fake nvidia-smi and nvidia-cuda-mps-control in usr/bin
        self.kubeconfig = kubeconfig
        self.verbose = verbose
        self.extra_args = tuple(extra_args)  # more `gpu-dra-agent node` flags, e.g. --consumable-shares memory
        self.process: subprocess.Popen[bytes] | None = None
        self.kubelet = FakeKubelet(self.kubelet_root, timeout=20.0)
        self._log: IO[bytes] | None = None

    @property
    def sockets(self) -> tuple[Path, Path]:
        """The registration socket and the DRA service socket the agent serves (DESIGN section 2)."""
        return registration_socket_path(self.kubelet_root, DRIVER), dra_socket_path(self.kubelet_root, DRIVER)

    def start(self) -> None:
        longest = max(self.sockets, key=lambda p: len(bytes(p)))
        if len(bytes(longest)) > MAX_SOCKET_PATH:
            too_long = f"{longest} is too long for a unix socket ({MAX_SOCKET_PATH} bytes)"
            raise DemoError(f"{too_long}; use a shorter --workdir")
        for d in (self.kubelet_root, self.cdi_root, self.state_dir):
            d.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "agent.cli",
            "node",
            "--node-name",
            self.name,
            "--nvml",
            f"fake:{self.machine}",
            "--kubeconfig",
            str(self.kubeconfig),
            "--kubelet-root",
            str(self.kubelet_root),
            "--cdi-root",
            str(self.cdi_root),
            "--state-dir",
            str(self.state_dir),
            "--driver-root",
            str(self.driver_root),
            "--metrics-addr",
            "",
            "--log-format",
            "text",
            *self.extra_args,
        ]
        self._log = None if self.verbose else self.log_path.open("ab")
        env = {**os.environ, persist.ENV: str(self.gpu_state)}
        self.process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT if self._log else None, env=env
        )

    def sharing_report(self, claim_uid: str, device_names: Sequence[str]) -> list[str]:
        """What the node shows of a claim's sharing: each GPU's compute mode and time slice (from the fake
        GPUs), and the claim's MPS control daemon, asked through its pipe directory as a client would."""
        fake = FakeNvml(get_machine(self.machine), self.gpu_state)
        lines = []
        for name in device_names:
            parsed = parse_device_name(name)
            minor = parsed.minor if isinstance(parsed, GpuName) else parsed.parent_minor
            gpu = next(g for g in fake.gpus if g.minor == minor)
            servers = [str(p.pid) for p in gpu.processes if p.name == "nvidia-cuda-mps-server"]
            server = "pid " + ", ".join(servers) if servers else "none"
            lines.append(
                f"{name}: compute mode {COMPUTE_MODES[gpu.compute_mode]}, time slice "
                f"{TIMESLICES[gpu.timeslice]}, MPS server {server}"
            )
        pipe = self.state_dir / "mps" / claim_uid / "pipe"
        if pipe.is_dir():
            ask = ["get_server_list", "get_default_active_thread_percentage"]
            ask += [f"get_default_device_pinned_mem_limit {i}" for i in range(len(device_names))]
            done = subprocess.run(  # the fake binary, with the claim's pipe directory, as a CUDA client would
                [str(self.driver_root / "usr/bin" / MPS_CONTROL)],
                input="\n".join(ask) + "\n",
                text=True,
                capture_output=True,
                env={**os.environ, persist.ENV: str(self.gpu_state), "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
                timeout=30,
                check=False,
            )
            if done.returncode != 0:
                lines.append(f"MPS control daemon at {pipe}: not answering ({done.stderr.strip()})")
            else:
                pid, percentage, *limits = done.stdout.split()
                pinned = ", ".join(f"{limit} on {name}" for limit, name in zip(limits, device_names, strict=True))
                lines.append(
                    f"MPS control daemon pid {pid} at {pipe}: active thread percentage {percentage}, "
                    f"pinned memory limit {pinned}"
                )
        return lines

    def wait_registered(self, timeout: float = 30.0) -> Plugin:
        """Scan the plugin registry as the kubelet does until the agent has registered."""

        def registered() -> Plugin | None:
            self.kubelet.scan()
            try:
                return self.kubelet.plugin(DRIVER)
            except Exception:
                return None

        return self.wait_for(registered, f"the agent on {self.name} to register with the kubelet", timeout)

    def wait_for(self, check: Callable[[], T | None], what: str, timeout: float) -> T:
        """Poll `check` until it gives a value; fail early, with the log's tail, if the agent died."""
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value is not None:
                return value
            if self.process is not None and self.process.poll() is not None:
                raise DemoError(f"the agent on {self.name} exited with {self.process.returncode}{self._log_tail()}")
            if time.monotonic() > deadline:
                raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}{self._log_tail()}")
            time.sleep(0.05)

    def terminate(self, timeout: float = 15.0) -> int:
        """SIGTERM, as the kubelet's pod shutdown sends; the agent's exit code."""
        if self.process is None:
            return 0
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise DemoError(f"the agent on {self.name} ignored SIGTERM for {timeout:.0f}s") from None

    def close(self) -> None:
        """Leave nothing behind, whatever happened: kill the agent if it still runs."""
        self.kubelet.close()
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _log_tail(self, lines: int = 15) -> str:
        if self.verbose or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"\nlast lines of {self.log_path}:\n" + "\n".join(f"  {line}" for line in tail)
