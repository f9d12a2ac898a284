"""`gpu-dra-agent replay-trace` end to end on a small synthetic trace, and on a real pod-list variant."""

from __future__ import annotations

import json
import pathlib

import pytest

from agent.cli import main

NODES = "sn,cpu_milli,memory_mib,gpu,model\n" + "".join(
    f"node-{i},{32000 if i % 2 else 64000},131072,{8 if i % 3 else 2},{'V100M32' if i % 4 == 0 else 'T4'}\n"
    for i in range(40)
)
PODS_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n"
)
# every GPU request is under 1% of the capacity, so the arrived share passes through every level
KINDS = [
    (4000, 8192, 1, 1000, ""),
    (2000, 4096, 1, 500, ""),
    (2000, 4096, 1, 250, ""),
    (8000, 16384, 2, 1000, ""),
    (16000, 32768, 0, 0, ""),
    (4000, 8192, 1, 700, "V100M32"),
]
PODS = PODS_HEADER + "".join(
    f"pod-{i:03d},{c},{m},{g},{milli},{spec},LS,Running,0,1,0\n"
    for i, (c, m, g, milli, spec) in enumerate(KINDS[j % len(KINDS)] for j in range(60))
)


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
    trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, err = run_json(capsys, "--trace-dir", str(trace_dir), "--seeds", "3")
    assert code == 0
    assert list(result) == ["random", "dotprod", "clustering", "packing", "bestfit", "fgd", "ours"]
    for entry in result.values():
        assert entry["seeds"] == 3 and 0 <= float(entry["unallocatedGpuPercent"]) <= 100  # type: ignore[arg-type]
    assert "unallocated GPU %" in err and "fgd" in err


def test_ours_does_not_depend_on_the_tie_regime(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, fixed, _ = run_json(capsys, "--trace-dir", str(trace_dir), "--seeds", "2", "--policy", "ours")
    _, rand, _ = run_json(capsys, "--trace-dir", str(trace_dir), "--seeds", "2", "--policy", "ours", "--ties", "random")
    assert fixed == rand


def test_bad_input_exits_nonzero_with_a_sentence(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--policy", "magic")  # tried: unknown policy
    assert code == 2 and "unknown policy magic" in err
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir / "nope"))  # tried: a missing directory
    assert code == 2 and "cannot read the trace" in err
    (trace_dir / "bad.csv").write_text(PODS_HEADER + "x,1,1,one,0,,LS,R,0,0,0\n")  # tried: a non-numeric GPU count
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--pods", "bad.csv")
    assert code == 2 and "bad pod row 'x'" in err


def test_runs_on_a_multigpu_variant_of_the_real_trace(
    shared_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, result, _ = run_json(
        capsys,
        "--trace-dir",
        str(shared_dir / "data/traces"),
        "--pods",
        "openb_pod_list_multigpu50.csv",
        "--seeds",
        "1",
        "--policy",
        "packing",
    )
    assert code == 0 and 0 < float(result["packing"]["unallocatedGpuPercent"]) < 30  # type: ignore[arg-type]


def test_a_short_row_names_the_file_and_line(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Tried: a pod row cut short (a truncated download); it used to end in a TypeError traceback."""
    lines = PODS.splitlines(keepends=True)
    (trace_dir / "short.csv").write_text("".join(lines[:5]) + "pod-x,4000,8192\n" + "".join(lines[5:]))
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--pods", "short.csv", "--seeds", "1")
    assert code == 2
    assert f"{trace_dir / 'short.csv'}:6: 3 fields where the header has 11" in err
    assert "Traceback" not in err


def test_a_long_row_and_an_empty_file_are_refused(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace_dir / "long.csv").write_text(NODES + "node-x,1,1,1,T4,extra\n")
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--nodes", "long.csv", "--seeds", "1")
    assert code == 2 and f"{trace_dir / 'long.csv'}:42: 6 fields where the header has 5" in err
    (trace_dir / "empty.csv").write_text("")
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--nodes", "empty.csv", "--seeds", "1")
    assert code == 2 and "empty.csv: empty, expected a CSV header line" in err


def test_a_bad_value_names_its_line(trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    (trace_dir / "bad.csv").write_text(PODS_HEADER + "a,1,1,1,1000,,LS,R,0,0,0\n" + "x,1,1,one,0,,LS,R,0,0,0\n")
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), "--pods", "bad.csv")
    assert code == 2 and f"{trace_dir / 'bad.csv'}:3: bad pod row 'x'" in err


@pytest.mark.parametrize(
    ("file", "row", "says"),
    [
        ("nodes", "node-x,-32000,131072,8,T4", "negative cpu_milli, memory_mib or gpu"),
        ("nodes", "node-x,32000,-1,8,T4", "negative cpu_milli, memory_mib or gpu"),
        ("nodes", "node-x,32000,131072,-8,T4", "negative cpu_milli, memory_mib or gpu"),
        ("pods", "pod-x,-4000,8192,1,1000,,LS,Running,0,1,0", "negative cpu_milli or memory_mib"),
        ("pods", "pod-x,4000,-8192,1,1000,,LS,Running,0,1,0", "negative cpu_milli or memory_mib"),
        ("pods", "pod-x,4000,8192,-1,1000,,LS,Running,0,1,0", "GPU request -1"),
    ],
)
def test_negative_values_are_refused(
    trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str], file: str, row: str, says: str
) -> None:
    """Tried: negative CPU, memory and GPU counts, which used to be replayed as capacity or demand."""
    text = NODES if file == "nodes" else PODS
    (trace_dir / "neg.csv").write_text(text + row + "\n")
    code, _, err = run_json(capsys, "--trace-dir", str(trace_dir), f"--{file}", "neg.csv", "--seeds", "1")
    assert code == 2 and says in err and "neg.csv:" in err


@pytest.mark.parametrize("policy", [",", " , ", ""])
def test_a_policy_list_naming_nothing_is_a_usage_error(
    trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str], policy: str
) -> None:
    code, result, err = run_json(capsys, "--trace-dir", str(trace_dir), "--policy", policy, "--seeds", "1")
    assert code == 2 and "--policy names no policy" in err


def test_pods_all_replays_every_list_under_both_regimes_in_parallel(
    trace_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every openb_pod_list_*.csv in the directory, both tie regimes, over two processes: the same numbers as
    one list replayed alone in this process, one table per regime with the paired ours-fgd column."""
    (trace_dir / "openb_pod_list_gpushare.csv").write_text(
        PODS_HEADER + "".join(f"pod-{i:03d},2000,4096,1,{250 + 125 * (i % 5)},,LS,Running,0,1,0\n" for i in range(60))
    )
    (trace_dir / "notes.csv").write_text("not,a,pod,list\n")  # not named like a pod list: left alone
    code, result, err = run_json(
        capsys,
        "--trace-dir",
        str(trace_dir),
        "--pods",
        "all",
        "--ties",
        "both",
        "--seeds",
        "2",
        "--jobs",
        "2",
        "--policy",
        "fgd,ours,random",
    )
    assert code == 0
    assert list(result) == ["fixed", "random"]
    for regime in result.values():
        assert list(regime) == ["default", "gpushare"]  # default first, then by name
    fixed, rand = result["fixed"], result["random"]
    assert fixed["gpushare"]["ours"] == rand["gpushare"]["ours"]  # settles its own ties: ran once, both shown
    _, alone, _ = run_json(
        capsys,
        "--trace-dir",
        str(trace_dir),
        "--pods",
        "openb_pod_list_gpushare.csv",
        "--seeds",
        "2",
        "--jobs",
        "1",
        "--policy",
        "fgd,ours,random",
        "--ties",
        "random",
    )
    assert rand["gpushare"] == alone
    assert "ties fixed" in err and "ties random" in err and "ours-fgd" in err and "gpushare" in err


def test_pods_all_refuses_a_directory_without_pod_lists_and_bad_job_counts(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "openb_node_list_gpu_node.csv").write_text(NODES)
    code, _, err = run_json(capsys, "--trace-dir", str(tmp_path), "--pods", "all")  # tried: no pod list at all
    assert code == 2 and "no openb_pod_list_*.csv files" in err
    code, _, err = run_json(capsys, "--trace-dir", str(tmp_path), "--jobs", "0")  # tried: zero processes
    assert code == 2 and "--jobs must be at least 1" in err
