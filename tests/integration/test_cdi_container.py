"""A real container engine applies a claim's CDI spec: podman with Debian's runc, over the fake driver root.

The agent (in-process, fake NVML and API) prepares a claim on a fake driver root whose libraries are real ELF
shared objects; podman runs a busybox container from a bare rootfs with the claim's CDI device id. With no
GPU here, the spec's device nodes are pointed at /dev/null in the copy podman reads (hostPath); everything
else is the written spec. Without nvidia-cdi-hook the container sees the libraries and finds libcuda.so.1
once it runs ldconfig itself; with the hook (built from NVIDIA's Go module, v1.20.2) the spec's hooks alone
make `ldconfig -p` list libcuda.so.1 and libnvidia-ml.so.1. Podman reads CDI specs only from /etc/cdi and
/var/run/cdi, so the copy goes to /var/run/cdi under the claim's own file name (JSON, as the agent writes it)
and is removed afterwards.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import fakes.apiserver
from agent.claims import cdi
from agent.node import NodeAgent, NodeConfig
from agent.nvml.source import open_nvml
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.driver_files import VERSION
from tests.integration.test_node_support import DRIVER, MACHINE, NODE, allocate_claim, create_node
from tests.node import images

CDI_DIR = pathlib.Path("/var/run/cdi")
LIMITS = ("--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024")  # runc here needs them explicit


def engine() -> str:
    """podman, or a skip saying why it cannot run here (`make test` installs podman and runc where it can)."""
    podman, runc = shutil.which("podman"), shutil.which("runc")
    if podman is None or runc is None:
        pytest.skip("podman and runc are not installed (apt-get install podman runc)")
    if os.geteuid() != 0:
        pytest.skip("podman with --rootfs and CDI specs in /var/run/cdi needs root here")
    return podman


@pytest.fixture(scope="module")
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        create_node(srv.api_client())
        yield srv


@pytest.fixture
def rootfs(tmp_path: pathlib.Path) -> pathlib.Path:
    """A bare container root: static busybox and the machine's static ldconfig, nothing of NVIDIA's."""
    try:
        busybox = images.busybox()
    except images.ImageError as error:
        pytest.skip(str(error))
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    root = tmp_path / "rootfs"
    for folder in ("bin", "sbin", "etc", "tmp", "proc", "sys", "dev"):
        (root / folder).mkdir(parents=True)
    shutil.copy(busybox, root / "bin/busybox")
    for applet in ("sh", "ls", "cat", "readlink"):
        os.symlink("busybox", root / "bin" / applet)
    shutil.copy(ldconfig, root / "sbin/ldconfig")
    return root


def engine_runs(podman: str, rootfs: pathlib.Path) -> None:
    """Skip, saying why, where podman cannot run any container here (cgroups, storage): the machine's limit,
    not what these tests check."""
    done = subprocess.run(
        [
            podman,
            "--runtime",
            "runc",
            "run",
            "--rm",
            "--network",
            "none",
            *LIMITS,
            "--rootfs",
            str(rootfs),
            "/bin/sh",
            "-c",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"podman cannot run a plain container here: {done.stderr.strip()[-300:]}")


def prepare(tmp_path: pathlib.Path, server: fakes.apiserver.ApiServer, hook: str | None) -> tuple[str, dict[str, Any]]:
    """Prepare a one-GPU claim with the agent on a fake driver root; its CDI device id and written spec."""
    driver_root = tmp_path / "driver-root"
    install_driver_root(driver_root)
    config = NodeConfig(
        NODE,
        DRIVER,
        tmp_path / "kubelet",
        tmp_path / "cdi",
        tmp_path / "state",
        driver_root=driver_root,
        host_driver_root=str(driver_root),
        nvidia_cdi_hook_path=hook,
    )
    api = server.api_client()
    ref = allocate_claim(api, f"ctr-{uuid.uuid4().hex[:8]}", ["gpu-0"])
    with open_nvml(MACHINE) as nvml:
        agent = NodeAgent(config, nvml, rest=server.rest())
        assert agent.driver.hook == hook
        result = agent.preparer.prepare([ref])[ref.uid]
    assert result.error == "", result.error
    [device_id] = result.devices[0].cdi_device_ids
    written = config.cdi_root / cdi.spec_file_name(ref.uid)
    assert written.suffix == ".json"
    spec = json.loads(written.read_text())  # the agent writes JSON specs (issue 37)
    return device_id, spec


def run(podman: str, rootfs: pathlib.Path, device_id: str, spec: dict[str, Any], script: str) -> str:
    """Run `script` in a container given `device_id`, podman reading a copy of `spec` whose device nodes are
    /dev/null (no GPU here)."""
    copy = dict(spec)
    edits = [copy.get("containerEdits") or {}] + [d["containerEdits"] for d in copy["devices"]]
    for e in edits:
        e["deviceNodes"] = [{**n, "hostPath": "/dev/null"} for n in e.get("deviceNodes") or ()]
    copy["cdiVersion"] = cdi.minimum_version(copy)
    uid = device_id.split("=", 1)[1].rsplit("-gpu-", 1)[0]
    CDI_DIR.mkdir(parents=True, exist_ok=True)
    path = CDI_DIR / cdi.spec_file_name(uid)
    path.write_text(json.dumps(copy))  # as the agent writes it: podman's CDI library reads the .json file
    try:
        done = subprocess.run(
            [
                podman,
                "--runtime",
                "runc",
                "run",
                "--rm",
                "--network",
                "none",
                *LIMITS,
                "--device",
                device_id,
                "--rootfs",
                str(rootfs),
                "/bin/sh",
                "-c",
                script,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        path.unlink(missing_ok=True)
    assert done.returncode == 0, f"podman failed ({done.returncode}):\n{done.stderr}\n{done.stdout}"
    return done.stdout


def test_without_the_hook_the_container_sees_the_libraries_and_its_ldconfig_finds_them(
    tmp_path: pathlib.Path, server: fakes.apiserver.ApiServer, rootfs: pathlib.Path
) -> None:
    podman = engine()
    engine_runs(podman, rootfs)
    device_id, spec = prepare(tmp_path, server, hook=None)
    assert "hooks" not in spec["containerEdits"]
    lib_dir = next(
        m["containerPath"]
        for m in spec["containerEdits"]["mounts"]
        if m["containerPath"].endswith(f"/libcuda.so.{VERSION}")
    ).rsplit("/", 1)[0]
    out = run(
        podman,
        rootfs,
        device_id,
        spec,
        f"echo VISIBLE=$NVIDIA_VISIBLE_DEVICES; ls {lib_dir}; ls /usr/bin /dev;"
        " ldconfig -p | grep -c nv || true; ldconfig; ldconfig -p",
    )
    listed = out.split()
    assert "VISIBLE=void" in listed
    assert f"libcuda.so.{VERSION}" in listed and f"libnvidia-ml.so.{VERSION}" in listed
    assert {"nvidia-smi", "nvidia-cuda-mps-control", "nvidia0", "nvidiactl", "nvidia-uvm"} <= set(listed)
    before, after = out.split("\n0\n", 1)  # nothing NVIDIA's in the loader cache until ldconfig ran
    assert "libcuda.so.1" not in before
    assert f"=> {lib_dir}/libcuda.so.1" in after and f"=> {lib_dir}/libnvidia-ml.so.1" in after


def test_with_nvidia_cdi_hook_the_spec_alone_makes_libcuda_resolvable(
    tmp_path: pathlib.Path, server: fakes.apiserver.ApiServer, rootfs: pathlib.Path
) -> None:
    podman = engine()
    engine_runs(podman, rootfs)
    from tests.container.cdi_hook import BuildTimeout, build, built, go_command

    if built() is None and go_command() is None:
        pytest.skip("nvidia-cdi-hook is not built and `go` is not on PATH to build it (Go module v1.20.2)")
    try:
        hook = str(build(budget_s=900))
    except BuildTimeout as exc:  # too slow here, not broken; a failed build fails the test
        pytest.skip(str(exc))
    device_id, spec = prepare(tmp_path, server, hook=hook)
    assert [h["args"][1] for h in spec["containerEdits"]["hooks"]] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    lib_dir = spec["containerEdits"]["hooks"][2]["args"][3]
    script = f"ldconfig -p; readlink {lib_dir}/libcuda.so; readlink {lib_dir}/libcuda.so.1"
    out = run(podman, rootfs, device_id, spec, script)
    resolvable = {line.split()[0] for line in out.splitlines() if " => " in line}
    assert {"libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4"} <= resolvable
    assert out.split()[-2:] == ["libcuda.so.1", f"libcuda.so.{VERSION}"]  # create-symlinks made both links


def test_a_root_built_from_the_spec_alone_loads_libcuda(
    tmp_path: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    """The issue's symptom, on the fake: a root made of the spec's mounts (and what its hooks do) and a program
    that dlopens libcuda.so.1. The fake library loads; it has no cuInit, which only a GPU machine has
    (tests/gpu)."""
    from tests.container.chroot_root import CUDA_PROGRAM, compile_program, missing_tools, run_in_spec_root

    if (why := missing_tools()) is not None:
        pytest.skip(why)
    hook = tmp_path / "nvidia-cdi-hook"  # never run: run_in_spec_root does what the spec's hooks ask
    hook.write_text("#!/bin/sh\nexit 1\n")
    hook.chmod(0o755)
    _, spec = prepare(tmp_path, server, hook=str(hook))
    for e in [spec["containerEdits"]] + [d["containerEdits"] for d in spec["devices"]]:
        e["deviceNodes"] = [{**n, "hostPath": "/dev/null"} for n in e.get("deviceNodes") or ()]  # no GPU here
    (tmp_path / "build").mkdir()
    program = compile_program(CUDA_PROGRAM, tmp_path / "build/program")
    done = run_in_spec_root(spec, tmp_path / "chroot", ["/program"], program)
    assert "dlopen libcuda.so.1: ok" in done.stdout, done.stdout + done.stderr
    assert "no cuInit" in done.stdout and done.returncode == 3


def test_each_requests_containers_get_only_that_requests_sharing_edits(
    tmp_path: pathlib.Path, server: fakes.apiserver.ApiServer, rootfs: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVIDIA's quickstart gpu-test5 shape: one claim, request r0 configured for MPS and r1 for TimeSlicing, a
    container per request. Tried before the fix: the r1 container got r0's CUDA_MPS_PIPE_DIRECTORY and its
    pipe mount (a CUDA program there would connect to the MPS daemon of another GPU)."""
    from fakes.nvml import persist

    podman = engine()
    engine_runs(podman, rootfs)
    monkeypatch.setenv(persist.ENV, str(tmp_path / "gpus.json"))  # the fake binaries share the fake GPUs
    driver_root = install_driver_root(tmp_path / "driver-root").parents[1]
    config = NodeConfig(
        NODE,
        DRIVER,
        tmp_path / "kubelet",
        tmp_path / "cdi",
        tmp_path / "state",
        driver_root=driver_root,
        host_driver_root=str(driver_root),
    )
    api = server.api_client()
    ref = allocate_requests(
        api,
        f"ts-mps-{uuid.uuid4().hex[:8]}",
        {"r0": "gpu-0", "r1": "gpu-1"},
        [{"strategy": "MPS"}, {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}],
    )
    with open_nvml(MACHINE) as nvml:
        agent = NodeAgent(config, nvml, rest=server.rest())
        result = agent.preparer.prepare([ref])[ref.uid]
        assert result.error == "", result.error
        ids = {d.request_names: d.cdi_device_ids[0] for d in result.devices}
        spec = json.loads((config.cdi_root / cdi.spec_file_name(ref.uid)).read_text())
        script = "echo PIPE=$CUDA_MPS_PIPE_DIRECTORY; ls -d /tmp/nvidia-mps 2>&1; cat /proc/self/mounts"
        try:
            mps, sliced = (run(podman, rootfs, ids[(r,)], spec, script) for r in ("r0", "r1"))
        finally:
            assert agent.preparer.unprepare([ref]) == {ref.uid: ""}
    assert "PIPE=/tmp/nvidia-mps" in mps.split() and " /tmp/nvidia-mps " in mps
    assert "PIPE=" in sliced.split() and " /tmp/nvidia-mps " not in sliced
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" not in str(spec["containerEdits"])  # nothing claim-wide


def allocate_requests(api: Any, name: str, devices: dict[str, str], sharing: list[dict[str, Any]]) -> Any:
    """A claim with one request per device, allocated with one GpuConfig per request (config.requests: [r])."""
    from kubernetes import client

    from agent.claimconfig.config import API_VERSION
    from agent.claims.types import ClaimRef

    resource = client.ResourceV1Api(api)
    requests = [{"name": r, "exactly": {"deviceClassName": "gpu.nvidia.com"}} for r in devices]
    created = resource.create_namespaced_resource_claim(
        "default",
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": requests}},
        },
    )
    body = api.sanitize_for_serialization(created)
    configs = [
        {
            "source": "FromClaim",
            "requests": [r],
            "opaque": {"driver": DRIVER, "parameters": {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": s}},
        }
        for r, s in zip(devices, sharing, strict=True)
    ]
    results = [{"request": r, "driver": DRIVER, "pool": NODE, "device": d} for r, d in devices.items()]
    body["status"] = {
        "allocation": {
            "devices": {"results": results, "config": configs},
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]
            },
        }
    }
    resource.replace_namespaced_resource_claim_status(name, "default", body)
    return ClaimRef("default", created.metadata.uid, name)
