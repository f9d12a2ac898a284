"""The command line as a new user meets it: `--version`, and one error line and exit code per kind of failure
whichever command fails (2: a setting or input that cannot work; 1: a failure at start-up)."""

from __future__ import annotations

import json
import os
import pathlib
from importlib.metadata import version

import pytest

from agent.cli import main


def test_version_names_the_installed_release(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"gpu-dra-agent {version('gpu-dra-agent')}"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["simulate", "{snapshot}", "--rounds", "0"], "--rounds must be at least 1"),
        (["simulate", "{missing}"], "cannot read"),
        (["arbiter", "--period", "0"], ""),  # whichever setting it names first
    ],
)
def test_a_setting_that_cannot_work_is_one_line_and_exit_2(
    argv: list[str], words: str, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = tmp_path / "s.json"
    snapshot.write_text(json.dumps({"nodes": [], "queues": [], "jobs": []}))
    filled = [a.format(snapshot=snapshot, missing=tmp_path / "absent.json") for a in argv]
    assert main(filled) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"gpu-dra-agent {argv[0]}: ") and words in err


def test_a_failure_at_start_up_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory", "--nvml", "fake:no-such-machine"]) in (1, 2)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gpu-dra-agent inventory: ")


@pytest.mark.parametrize(
    ("command", "before", "after"),
    [
        ("arbiter", {}, {"GRPC_EXPERIMENTS": "-event_engine_client"}),  # its node calls in gRPC's older poller
        ("arbiter", {"GRPC_EXPERIMENTS": "-mine"}, {"GRPC_EXPERIMENTS": "-mine"}),  # the operator's setting stays
        ("node", {}, {}),
    ],
)
def test_a_command_loads_grpc_with_its_own_settings_unless_the_operator_set_them(
    command: str, before: dict[str, str], after: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    environ = dict(before)
    monkeypatch.setattr(os, "environ", environ)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert environ == after
