"""`gpu-dra-agent simulate` end to end: real files, the real CLI entry point, JSON out, errors on stderr."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from typing import Any

import pytest

from agent.cli import main
from tests.unit.test_arbiter_support import doc, gang, job, node, pod, queue


def snapshot_file(tmp_path: pathlib.Path, document: Any) -> pathlib.Path:
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return path


def reclaim_scenario() -> dict[str, Any]:
    queues = [queue("a", quota=4), queue("b", quota=4)]
    jobs = [gang("ja", "a", 8, node="n", min_member=1), gang("jb", "b", 2, created="2025-01-01T01:00:00Z")]
    return doc([node("n", 8)], queues, jobs)


def test_simulate_prints_decisions_fair_shares_and_cycle_times(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = snapshot_file(tmp_path, reclaim_scenario())
    assert main(["simulate", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"pods", "fairShare", "rounds", "moves", "cycleSeconds"}
    assert out["rounds"] == 1 and len(out["cycleSeconds"]) == 1 and out["cycleSeconds"][0] >= 0
    assert out["fairShare"]["b"]["gpu"] == 2 and out["fairShare"]["a"]["gpu"] == 6
    assert out["pods"]["jb-0"] == {"outcome": "pending", "node": "n", "action": "pipeline"}
    evicted = [p for p, d in out["pods"].items() if d["action"] == "evict"]
    assert len(evicted) == 2 and all(out["pods"][p]["outcome"] == "evicted" for p in evicted)


def test_simulate_rounds_bind_what_was_pipelined(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = snapshot_file(tmp_path, reclaim_scenario())
    assert main(["simulate", str(path), "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rounds"] == 2 and len(out["cycleSeconds"]) == 2
    assert out["pods"]["jb-0"]["action"] == "bind" and out["pods"]["jb-0"]["outcome"] == "running"


def test_simulate_rounds_show_the_reclaim_of_the_first_round(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tried: two rounds of a reclaim. The last round only binds; the evictions of the first must still show."""
    path = snapshot_file(tmp_path, reclaim_scenario())
    assert main(["simulate", str(path), "--actions", "allocate,reclaim", "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    first, second = out["moves"]
    assert len(first["evict"]) == 2 and first["pipeline"] == ["jb-0", "jb-1"]
    assert second == {"bind": ["jb-0", "jb-1"]}


def test_simulate_runs_only_the_listed_actions(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = snapshot_file(tmp_path, reclaim_scenario())
    assert main(["simulate", str(path), "--actions", "allocate,preempt"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(d["action"] == "keep" for d in out["pods"].values())


def test_fractional_pods_report_their_gpu_index(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = snapshot_file(tmp_path, doc([node("n", 2)], [queue("q")], [gang("f", "q", 1, gpus=0.5)]))
    assert main(["simulate", str(path), "--actions", "allocate"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pods"]["f-0"]["gpuIndex"] in (0, 1) and out["pods"]["f-0"]["action"] == "bind"


BAD = {
    "unknown queue": (doc([node("n")], [queue("q")], [gang("j", "ghost", 1)]), "unknown queue"),
    "job in a parent queue": (
        doc([node("n")], [queue("p"), queue("c", parent="p")], [gang("j", "p", 1)]),
        "parent queue",
    ),
    "negative quantity": (doc([node("n", cpu=-1)], [queue("q")], []), "negative cpuMilli"),
    "cycle": (doc([node("n")], [queue("a", parent="b"), queue("b", parent="a")], []), "cycle"),
    "not JSON": ("{nodes: [", "not valid JSON"),
    # tried: "gpu" for "gpus" used to make a silent 0-GPU pod
    "misspelt field": (
        doc([node("n")], [queue("q")], [job("j", "q", [{**pod("p"), "gpu": 1}])]),
        "pod 'p' has an unknown field 'gpu'",
    ),
    "misspelt top-level field": ({**doc([node("n")], [queue("q")], []), "job": []}, "unknown field 'job'"),
    "misspelt queue resource field": (
        doc([node("n")], [{**queue("q"), "gpu": {"qouta": 1}}], []),
        "unknown field 'qouta'",
    ),
    "gpuIndex true": (
        doc([node("n")], [queue("q")], [job("j", "q", [pod("p", 0.5, "n", gpuIndex=True)])]),
        "gpuIndex that is not a GPU index: True",
    ),
    "nvlink domain of booleans": (
        doc([node("n", nvlinkDomains=[[True, False]])], [queue("q")], []),
        "not a list of GPU indices",
    ),
    "ten million GPUs": (doc([node("n", 10**7)], [queue("q")], []), "more than the 1024"),
    "1e308 GPUs on a pod": (doc([node("n")], [queue("q")], [job("j", "q", [pod("p", 1e308)])]), "at most 1e+18"),
    "1e308 quota": (doc([node("n")], [queue("q", quota=1e308)], []), "at most 1e+18"),
    "400-digit memory": (doc([node("n", mem=10**400)], [queue("q")], []), "at most 1e+18"),
    "100k-deep nesting": ("[" * 100_000 + "]" * 100_000, "nests JSON too deeply"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_snapshot_exits_non_zero_with_one_sentence_and_no_traceback(tmp_path: pathlib.Path, case: str) -> None:
    document, words = BAD[case]
    path = snapshot_file(tmp_path, document)
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "simulate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0]
    assert "Traceback" not in proc.stderr


def test_missing_file_and_unknown_action_are_clear_errors(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", str(tmp_path / "absent.json")]) != 0
    assert "cannot read" in capsys.readouterr().err
    path = snapshot_file(tmp_path, reclaim_scenario())
    assert main(["simulate", str(path), "--actions", "allocate,backfill"]) != 0
    assert "unknown action 'backfill'" in capsys.readouterr().err


def test_simulate_takes_shared_claims_as_gpu_memory(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 8Gi shares of 79.6 GiB H100s: nine fit a GPU, so 18 of 19 run on two GPUs and one waits
    h100 = 81559 << 20
    shares = [{k: v for k, v in pod(f"s{i}").items() if k != "gpus"} | {"gpuMemory": 8 << 30} for i in range(19)]
    document = doc([node("n", 2, gpuMemory=h100)], [queue("q")], [job("infer", "q", shares, min_member=1)])
    assert main(["simulate", str(snapshot_file(tmp_path, document)), "--rounds", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    running = [p for p in out["pods"].values() if p["outcome"] == "running"]
    assert len(running) == 18
    assert sorted(p["gpuIndex"] for p in running) == [0] * 9 + [1] * 9


def test_the_shipped_example_shows_gangs_hierarchy_and_reclaim(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.commands.simulate import EXAMPLE

    assert main(["simulate", str(EXAMPLE), "--actions", "allocate,reclaim"]) == 0
    pods = json.loads(capsys.readouterr().out)["pods"]
    evicted = sorted(p for p, d in pods.items() if d["action"] == "evict")
    assert evicted and all(pods[p]["evictedBy"] == "reclaim" for p in evicted)
    assert {pods[f"vision-train-{i}"]["action"] for i in range(4)} == {"pipeline"}  # the gang, whole
    assert {pods[f"nlp-finetune-{i}"]["action"] for i in range(2)} == {"bind"}


def test_the_schema_is_checked(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    from agent.commands.simulate import EXAMPLE

    doc = json.loads(EXAMPLE.read_text())
    doc["config"]["placement"]["gpu"] = "fgd"
    doc["queues"][1]["preemptMinRuntime"] = "soon"  # not a Go duration
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(doc))
    assert main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-dra-agent simulate: ") and "preemptMinRuntime" in err
    doc["queues"][1]["preemptMinRuntime"] = "5m"
    doc["nodes"][0]["gpuModel"] = 7
    path.write_text(json.dumps(doc))
    assert main(["simulate", str(path)]) == 2
    assert "gpuModel" in capsys.readouterr().err
