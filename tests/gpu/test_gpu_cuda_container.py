"""On a GPU machine (opt-in: `.venv/bin/pytest tests/gpu -m gpu`): a claim's CDI spec, written by the agent on
real NVML and the machine's real driver root, is enough for CUDA.

The agent prepares a one-GPU claim (the API is the fake; NVML and the driver files are real). A root is built
from the written spec alone (tests/container/chroot_root.py: its mounts and device nodes bound into an empty
root, what its hooks would do, a C program calling cuInit and cuDeviceGetCount through dlopen("libcuda.so.1")
and the C library that it and the driver's files link, as any base image has it) and the program runs
chrooted: cuInit succeeds and it sees exactly one GPU, and `nvidia-smi -L` there lists only the claimed GPU.
Read-only on the GPU: a GPU with MIG mode off is claimed as a whole, nothing is reconfigured.
"""

from __future__ import annotations

import pathlib
import re
import shutil
from collections.abc import Iterator

import pytest
import yaml

import fakes.apiserver
from agent.claims import cdi
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import open_nvml
from tests.container.chroot_root import CUDA_PROGRAM, compile_program, missing_tools, run_in_spec_root
from tests.integration.test_node_support import DRIVER, NODE, allocate_claim, create_node

pytestmark = pytest.mark.gpu


def real_nvml_or_skip() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        pytest.skip(f"no GPU here: pynvml.nvmlInit() fails ({exc})")


@pytest.fixture(scope="module")
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        create_node(srv.api_client())
        yield srv


def test_a_claims_spec_alone_runs_cuda_on_exactly_its_gpu(
    tmp_path: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    real_nvml_or_skip()
    if (why := missing_tools()) is not None:
        pytest.skip(why)
    # nvidia-cdi-hook where installed; otherwise a stand-in path, never run (run_in_spec_root does the hooks)
    hook = shutil.which("nvidia-cdi-hook")
    if hook is None:
        stand_in = tmp_path / "nvidia-cdi-hook"
        stand_in.write_text("#!/bin/sh\nexit 1\n")
        stand_in.chmod(0o755)
        hook = str(stand_in)
    config = NodeConfig(
        NODE, DRIVER, tmp_path / "kubelet", tmp_path / "cdi", tmp_path / "state", nvidia_cdi_hook_path=hook
    )
    with open_nvml("real") as nvml:
        agent = NodeAgent(config, nvml, rest=server.rest())
        api = server.api_client()
        whole = [g for g in agent.inventory.gpus if not g.mig_enabled]
        if not whole:
            pytest.skip("every GPU here is in MIG mode; this check claims a whole GPU and changes nothing")
        gpu = whole[-1]  # the last one: a container that saw every GPU would show more than index 0
        assert agent.driver.files.libraries, f"no driver libraries found under /: {agent.driver.files.missing}"
        ref = allocate_claim(api, "cuda-check", [f"gpu-{gpu.minor}"])
        result = agent.preparer.prepare([ref])[ref.uid]
        assert result.error == "", result.error
        try:
            written = (config.cdi_root / cdi.spec_file_name(ref.uid)).read_text()
            print(written)  # on record with the run's output
            spec = yaml.safe_load(written)
            (tmp_path / "build").mkdir()
            program = compile_program(CUDA_PROGRAM, tmp_path / "build/program")
            done = run_in_spec_root(spec, tmp_path / "cuda", ["/program"], program)
            print(done.stdout, done.stderr)
            assert done.returncode == 0, done.stdout + done.stderr
            assert "cuInit: 0" in done.stdout and re.search(r"devices=1\b", done.stdout), done.stdout
            smi_path = next(
                m["containerPath"]
                for m in spec["containerEdits"]["mounts"]
                if m["containerPath"].endswith("/nvidia-smi")
            )
            smi = run_in_spec_root(spec, tmp_path / "smi", [smi_path, "-L"])
            print(smi.stdout, smi.stderr)
            listed = [line for line in smi.stdout.splitlines() if line.startswith("GPU ")]
            assert len(listed) == 1 and gpu.uuid in listed[0], smi.stdout + smi.stderr
        finally:
            assert agent.preparer.unprepare([ref]) == {ref.uid: ""}
