"""The command line as a new user meets it: `--version`, and one error line and exit code per kind of failure
whichever command fails (2: a setting or input that cannot work; 1: a failure at start-up)."""

from __future__ import annotations

import json
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
