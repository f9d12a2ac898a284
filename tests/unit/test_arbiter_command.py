"""`gpu-dra-agent arbiter` settings an operator can get wrong end the process with one sentence, before any
connection is made."""

from __future__ import annotations

import argparse
import pathlib

import pytest

from agent.commands import arbiter


def run(tmp_path: pathlib.Path, *flags: str) -> int:
    token = tmp_path / "token"
    token.write_text("s3cret-token-of-enough-length\n")
    parser = argparse.ArgumentParser()
    arbiter.add_arguments(parser)
    return arbiter.run(parser.parse_args(["--reservation-token-file", str(token), *flags]))


def test_gpu_placement_from_the_environment_is_checked(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPU_PLACEMENT", "tightest")
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        "GPU_PLACEMENT (the environment's --gpu-placement): 'tightest' is not one of fgd, binpack, spread")


def test_gpu_placement_flag_refuses_an_unknown_policy(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        run(tmp_path, "--gpu-placement", "random")
    assert exit_.value.code == 2
