"""`make demo` (`python -m fakes.demo`) end to end: real agent subprocesses, API server, kubelet and scheduler fakes."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fakes.demo.run import main

EXAMPLES = Path(__file__).resolve().parents[2] / "daemonset" / "examples"
CLAIM_LINE = re.compile(r"^  (\S+)  \(node (\S+), uid (\S+)\)$", re.MULTILINE)


def example_claims() -> set[str]:
    return {
        d["metadata"]["name"]
        for f in EXAMPLES.glob("*.yaml")
        for d in yaml.safe_load_all(f.read_text())
        if d and d["kind"] == "ResourceClaimTemplate"
    }


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A work directory short enough for unix socket paths (pytest's tmp_path can be too deep)."""
    path = Path(tempfile.mkdtemp(prefix="demo-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_gone(pid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_demo_prepares_every_example_claim_and_ends_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    sections = [int(n) for n in re.findall(r"^== (\d+)\. ", out, re.MULTILINE)]
    assert sections == list(range(1, len(sections) + 1)) and len(sections) >= 8, sections

    claims = {m[0]: (m[1], m[2]) for m in CLAIM_LINE.findall(out)}
    assert set(claims) == example_claims()  # the MIG one too: it lands on the mixed-mig node
    for name, (_node, uid) in claims.items():
        assert re.search(rf"k8s\.gpu\.nvidia\.com/claim={uid}-gpu-\d", out), f"no CDI id for {name}"
    eight = claims["eight-nvlinked-gpus"][1]
    assert len(re.findall(rf"claim={eight}-gpu-\d\b", out)) == 8
    assert claims["mig-1g10gb"][0].endswith("mixed-mig")
    # Sharing is in force on the node, not only asked: the MPS claim's own daemon with its limits, the
    # time-sliced GPU's slice; both undone at unprepare (the pid check below finds the daemon gone).
    mps_uid = claims["mps-shared-gpu"][1]
    assert re.search(r"gpu-\d: compute mode Exclusive_Process, time slice Default, MPS server pid \d+", out)
    assert re.search(
        rf"MPS control daemon pid \d+ at \S+/state/mps/{mps_uid}/pipe: active thread percentage 50\.0, "
        r"pinned memory limit 10240M on gpu-\d",
        out,
    )
    assert re.search(r"gpu-\d: compute mode Default, time slice Long, MPS server none", out)
    assert re.search(
        r"mps-shared-gpu unprepared; on the node:\n\s+gpu-\d: compute mode Default, time slice "
        r"Default, MPS server none",
        out,
    )

    assert "kind: k8s.gpu.nvidia.com/claim" in out  # one claim's CDI spec, printed
    assert re.search(r"DEVICE\s+TYPE\s+PRODUCT / PROFILE\s+MEMORY\s+NVLINK DOMAIN", out)
    assert out.count("NVIDIA H100 80GB HBM3") >= 8
    cdi_dirs = re.findall(r"CDI dir of \S+: (.*)", out)
    assert cdi_dirs
    assert set(cdi_dirs) == {"empty"}
    # the device-plugin-style pod: nvidia.com/gpu through the scheduler's own claim, prepared like any other
    found = re.search(
        r"pod device-plugin-style-pod \(nvidia.com/gpu: 1\) bound to (\S+); claim "
        r"(device-plugin-style-pod-extended-resources-\w+) made by the scheduler",
        out,
    )
    assert found, out
    assert "ctr: nvidia.com/gpu -> request container-0-request-0" in out
    assert re.search(r"gpu-\d+\s+container-0-request-0\s+k8s\.gpu\.nvidia\.com/claim=", out)
    assert "pod device-plugin-style-pod done: claim unprepared and deallocated" in out
    # The MIG relabel on the DGX H100 node: devices before and after, as the slices show them.
    relabel = out[out.index("nvidia.com/mig.config=all-1g.10gb") :]
    assert re.search(r"nvidia\.com/mig\.config\.state: (\S+ -> )*pending -> success", relabel)
    assert re.search(r"before: 8 devices: 8x NVIDIA H100 80GB HBM3\n\s+after:\s+56 devices: 56x 1g\.10gb", relabel)
    assert out.count("exited 0; sockets removed") == 2
    for pid in re.findall(r"pid (\d+)", out):
        assert_gone(int(pid))
    # the queue scene: a 2 x 8-GPU gang across both nodes, then team-b reclaims team-a's burst over quota
    assert re.search(r"llm-train-0\s+admitted\s+gpu-node-0\s+gpu 0,1,2,3,4,5,6,7", out)
    assert re.search(r"llm-train-1\s+admitted\s+gpu-node-1\s+gpu 0,1,2,3,4,5,6,7", out)
    assert len(re.findall(r"event  sweep-\d-0: evicted by the arbiter \(reclaim\)", out)) == 2
    assert len(re.findall(r"eval-\d\s+admitted", out)) == 2
    assert re.search(r"team-b\s+research\s+8\s+8\s+8\s+8", out)
    # shared GPUs: ten 8Gi inference claims, nine on one H100, each its own CDI device with its limit
    shared = re.findall(r"inference-\d\s+8Gi\s+(gpu-\d)\s+\w{8}\s+memory=8Gi, shares=1\s+0\.100\s+0=8192M\s+\S+", out)
    assert shared == ["gpu-0"] * 9 + ["gpu-1"], out
    assert "gpu-0: 9 share(s), 0.904 of the GPU (72 of 79.6 GiB) in the queue" in out
    # multi-node NVLink: a 4-node ComputeDomain on the fake NVL72 rack, each daemon naming the same four peers
    peers = re.findall(
        r"gb200-nvl72-node0\d\s+127\.0\.0\.\d\s+index \d\s+Ready\s+nvidia-imex peers: (.*)  channels: "
        r"channel0",
        out,
    )
    assert peers == ["127.0.0.1, 127.0.0.2, 127.0.0.3, 127.0.0.4"] * 4, out
    assert "every IMEX daemon stopped, every channel node and CDI spec removed" in out


def test_demo_on_dgx_h100_alone_calls_the_mig_claim_unsatisfiable(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--machine", "dgx-h100"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert re.search(r"mig-1g10gb: unsatisfiable: .*no matching device", out)
    claims = {m[0] for m in CLAIM_LINE.findall(out)}
    assert claims == example_claims() - {"mig-1g10gb"}


def test_demo_fails_cleanly_when_the_agent_cannot_start(capsys: pytest.CaptureFixture[str], short_dir: Path) -> None:
    # Tried: a machine the NVML fake does not know; the agent exits at once.
    code = main(["--machine", "no-such-machine", "--workdir", str(short_dir)])
    captured = capsys.readouterr()
    assert code == 1
    assert "demo: the agent on node-0-no-such-machine exited" in captured.err
    assert "no-such-machine" in (short_dir / "node-0-no-such-machine" / "agent.log").read_text()
    assert f"work directory kept: {short_dir}" in captured.out


def test_demo_refuses_a_workdir_too_deep_for_unix_sockets(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # Tried: a work directory whose socket paths would pass the 107-byte unix socket limit.
    deep = tmp_path / ("d" * 80)
    code = main(["--machine", "dgx-h100", "--workdir", str(deep)])
    assert code == 1
    assert "too long for a unix socket" in capsys.readouterr().err
