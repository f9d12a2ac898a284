"""Every command behaves alike: exit 2 for a bad setting (flag or environment), 1 for a failure at start-up,
one line `gpu-dra-agent <command>: ...` naming the flag, every flag's environment variable and default in
--help, and a closed pipe ends the output quietly."""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

import pytest

from agent.commands import arbiter, node

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def driver_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The node agent checks its driver root's binaries first; give it a fake one so the setting under test
    is the one refused."""
    from tests.integration.test_node_support import fake_driver_root

    return fake_driver_root(tmp_path_factory.mktemp("driver"))


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "NODE_NAME", "NVML")}
    return subprocess.run(
        [sys.executable, "-m", "agent.cli", *args],
        env={**base, **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def one_line(done: subprocess.CompletedProcess[str], code: int, command: str, *words: str) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f"gpu-dra-agent {command}: " in lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_node_with_an_unknown_nvml_is_a_bad_setting(tmp_path: pathlib.Path, driver_root: pathlib.Path) -> None:
    done = cli(
        "node",
        "--node-name",
        "n",
        "--nvml",
        "bogus",
        "--kubeconfig",
        str(tmp_path / "k"),
        "--driver-root",
        str(driver_root),
    )
    one_line(done, 2, "node", "bogus")


@pytest.mark.parametrize("command", ["node", "arbiter"])
def test_a_missing_kubeconfig_is_a_bad_setting_for_both_daemons(
    command: str, tmp_path: pathlib.Path, driver_root: pathlib.Path
) -> None:
    token = tmp_path / "token"
    token.write_text("t" * 32)
    extra = [
        "--node-name",
        "n",
        "--nvml",
        "fake:dgx-h100",
        "--state-dir",
        str(tmp_path / "s"),
        "--cdi-root",
        str(tmp_path / "c"),
        "--kubelet-root",
        str(tmp_path / "k"),
        "--metrics-addr",
        "",
        "--driver-root",
        str(driver_root),
    ]
    if command == "arbiter":
        extra = ["--reservation-token-file", str(token)]
    done = cli(command, "--kubeconfig", str(tmp_path / "missing"), *extra)
    one_line(done, 2, command, "does not exist")


def test_replay_trace_errors_carry_the_prefix(tmp_path: pathlib.Path) -> None:
    done = cli("replay-trace", "--trace-dir", str(tmp_path), "--seeds", "0")
    one_line(done, 2, "replay-trace", "--seeds")


@pytest.mark.parametrize(
    ("variable", "value", "flag"),
    [
        ("RESYNC_INTERVAL", "soon", "--resync-interval"),
        ("PARTITIONABLE_DEVICES", "maybe", "--partitionable-devices"),
        ("HEALTH_EVENTS", "yes please", "--health-events"),
    ],
)
def test_a_bad_environment_value_names_the_variable_and_the_flag(variable: str, value: str, flag: str) -> None:
    done = cli("node", "--node-name", "n", env={variable: value})
    line = one_line(done, 2, "node", variable, flag, repr(value))
    assert "see gpu-dra-agent node --help" in line


def parsed(module: object, env: dict[str, str], monkeypatch: pytest.MonkeyPatch, *args: str) -> argparse.Namespace:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    return parser.parse_args(list(args))


def test_environment_fallbacks_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parsed(
        node, {"RESYNC_INTERVAL": "7.5", "PARTITIONABLE_DEVICES": "1", "MIG_RECONFIGURE": "FALSE"}, monkeypatch
    )
    assert (args.resync_interval, args.partitionable_devices, args.mig_reconfigure) == (7.5, True, False)
    flagged = parsed(node, {"PARTITIONABLE_DEVICES": "true"}, monkeypatch, "--no-partitionable-devices")
    assert flagged.partitionable_devices is False  # the flag wins over the environment
    assert parsed(arbiter, {"LEADER_ELECT": "0", "PERIOD": "3"}, monkeypatch).period == 3.0


@pytest.mark.parametrize("module", [node, arbiter])
def test_help_shows_every_flags_variable_and_default(module: object) -> None:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)  # type: ignore[attr-defined]
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "(env " in action.help, action.option_strings
        if action.default not in (None, False) or isinstance(action, argparse.BooleanOptionalAction):
            assert "default " in action.help, action.option_strings
    text = parser.format_help()
    assert "env KUBELET_ROOT; default /var/lib/kubelet" in text or module is arbiter
    assert "env LOG_FORMAT; default text" in " ".join(text.split())


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent.cli", "inventory", "--nvml", "fake:dgx-h100", "--output", "json"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first write, as `| head` is after its lines
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert err == ""
