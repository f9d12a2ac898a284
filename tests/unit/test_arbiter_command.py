"""`gpu-dra-agent arbiter` settings an operator can get wrong end the process with one sentence, before any
connection is made."""

from __future__ import annotations

import pathlib

import pytest

from agent.cli import main


def run(tmp_path: pathlib.Path, *flags: str) -> int:
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    return main(["arbiter", "--reservation-token-file", str(token), *flags])


def test_gpu_placement_from_the_environment_is_checked(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPU_PLACEMENT", "tightest")
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "gpu-dra-agent arbiter: GPU_PLACEMENT (the environment's --gpu-placement): 'tightest' is not one of fgd, "
        "binpack, spread (see gpu-dra-agent arbiter --help)"
    )


def test_gpu_placement_flag_refuses_an_unknown_policy(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path, "--gpu-placement", "random")
    assert exit_.value.code == 2


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--cycle-gap", "-1"), "--cycle-gap must be a number of seconds at or above 0, not -1.0"),
        (("--cycle-gap", "nan"), "--cycle-gap must be a number of seconds at or above 0, not nan"),
        (("--period", "0"), "--period must be a positive number of seconds, not 0.0"),
    ],
)
def test_a_bad_cycle_timing_ends_the_process_with_one_sentence(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    assert run(tmp_path, *flags) == 2
    assert capsys.readouterr().err.strip().endswith(message)
