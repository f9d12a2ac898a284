"""`gpu-dra-agent replay-trace` end to end on a small synthetic trace, and on a real pod-list variant."""

from __future__ import annotations

import json
import pathlib

import pytest

from agent.cli import main

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"node-{i},{32000 if i % 2 else 64000},131072,{8 if i % 3 else 2},{'V100M32' if i % 4 == 0 else 'T4'}\n"
    for i in range(40))
PODS_HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
               "creation_time,deletion_time,scheduled_time\n")
# every GPU request is under 1% of the capacity, so the arrived share passes through every level
KINDS = [(4000, 8192, 1, 1000, ""), (2000, 4096, 1, 500, ""), (2000, 4096, 1, 250, ""),
         (8000, 16384, 2, 1000, ""), (16000, 32768, 0, 0, ""), (4000, 8192, 1, 700, "V100M32")]
PODS = PODS_HEADER + "".join(
    f"pod-{i:03d},{c},{m},{g},{milli},{spec},LS,Running,0,1,0\n"
    for i, (c, m, g, milli, spec) in enumerate(KINDS[j % len(KINDS)] for j in range(60)))


@pytest.fixture
def trace_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES)
    (tmp_path / "openb_pod_list_default.csv").write_text(PODS)
    return tmp_path


def run_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, dict[str, object]], str]:
    code = main(["replay-trace", *args])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else {}), err


def test_all_policies_side_by_side_json_on_stdout_table_on_stderr(
        trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, result, err = run_json(capsys, "--trace-dir", str(trace_dir), "--seeds", "3")
    assert code == 0
    assert list(result) == ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "ours"]
    for entry in result.values():
        assert entry["seeds"] == 3 and 0 <= float(entry["unallocatedGpuPercent"]) <= 100  # type: ignore[arg-type]
    assert "unallocated GPU %" in err and "fgd" in err


def test_ours_does_not_depend_on_the_tie_regime(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, fixed, _ = run_json(capsys, "--trace-dir", str(trace_dir), "--seeds", "2", "--policy", "ours")
    _, rand, _ = run_json(capsys, "--trace-dir", str(trace_dir), "--seeds", "2", "--policy", "ours",
                          "--ties", "random")
    assert fixed == rand


def test_bad_input_exits_nonzero_with_a_sentence(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--policy", "magic")  # tried: unknown policy
    assert code == 2 and "unknown policy magic" in err
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir / "nope"))  # tried: a missing directory
    assert code == 2 and "cannot read the trace" in err
    (trace_dir / "bad.csv").write_text(PODS_HEADER + "x,1,1,one,0,,LS,R,0,0,0\n")  # tried: a non-numeric GPU count
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--pods", "bad.csv")
    assert code == 2 and "bad pod row 'x'" in err


def test_runs_on_a_multigpu_variant_of_the_real_trace(shared_dir: pathlib.Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, result, _ = run_json(capsys, "--trace-dir", str(shared_dir / "data/traces"),
                               "--pods", "openb_pod_list_multigpu50.csv", "--seeds", "1", "--policy", "packing")
    assert code == 0 and 0 < float(result["packing"]["unallocatedGpuPercent"]) < 30  # type: ignore[arg-type]
