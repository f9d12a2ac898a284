"""`gpu-dra-agent simulate` with reservations (the default) against --no-reservations: same decisions when the
nodes agree with the arbiter; a summary on request."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from agent.cli import main
from tests.integration.test_simulate_cli import reclaim_scenario, snapshot_file
from tests.unit.test_arbiter_support import doc, gang, job, node, pod, queue


def run(path: pathlib.Path, capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main(["simulate", str(path), *flags]) == 0
    out: dict[str, Any] = json.loads(capsys.readouterr().out)
    return out


SCENARIOS = {
    "reclaim": (reclaim_scenario(), ["--rounds", "2"]),
    "reclaim, one round": (reclaim_scenario(), []),
    "fractional": (doc([node("n", 2)], [queue("q")], [gang("f", "q", 3, gpus=0.5)]), ["--rounds", "2"]),
    "gangs over NVLink domains": (
        doc(
            [node(f"n{i}", 8, nvlinkDomains=[[0, 1, 2, 3], [4, 5, 6, 7]]) for i in range(3)],
            [queue("a", quota=12), queue("b", quota=12)],
            [
                gang("run", "a", 6, node="n0"),
                gang("big", "b", 4, gpus=2),
                job("mix", "a", [pod(f"m{i}", g) for i, g in enumerate([0.5, 0.5, 1, 0])]),
            ],
        ),
        ["--rounds", "3"],
    ),
}


@pytest.mark.parametrize("case", list(SCENARIOS), ids=list(SCENARIOS))
def test_decisions_are_the_same_with_and_without_reservations(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    document, flags = SCENARIOS[case]
    path = snapshot_file(tmp_path, document)
    with_commit = run(path, capsys, *flags)
    without = run(path, capsys, *flags, "--no-reservations")
    assert with_commit["pods"] == without["pods"]
    assert with_commit["fairShare"] == without["fairShare"] and with_commit["rounds"] == without["rounds"]
    assert with_commit["moves"] == without["moves"]
    assert set(with_commit) == {"pods", "fairShare", "rounds", "moves", "cycleSeconds"}


def test_report_counts_committed_gangs_and_released_reservations(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # round 1: ja's 8 pods run (adopted), two are evicted for jb; round 2: jb binds (one gang committed)
    path = snapshot_file(tmp_path, reclaim_scenario())
    out = run(path, capsys, "--rounds", "2", "--report-reservations")
    summary = out["reservations"]
    assert summary["committed"] == 1 and summary["refused"] == 0 and summary["relocated"] == 0
    assert len(summary["commitSeconds"]) == 2
    off = run(path, capsys, "--rounds", "2", "--report-reservations", "--no-reservations")
    assert off["reservations"]["committed"] == 0
