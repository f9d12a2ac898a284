"""`gpu-dra-agent node` started the way an operator gets it wrong: each mistake must end the process at once
with a non-zero status and one sentence on stderr (a JSON record with `--log-format json`), never a
traceback, and must leave nothing behind it was not asked to create."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import stat
import subprocess
from collections.abc import Iterator

import pytest

import fakes.apiserver
from tests.integration.test_node_support import (
    DRIVER,
    MACHINE,
    NODE,
    REPO,
    Daemon,
    agent_command,
    clean_env,
    fake_driver_root,
    running,
    short_tmpdir,
)


@pytest.fixture(scope="module")
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as s:
        yield s


_DRIVER_ROOT: list[pathlib.Path] = []  # the fake NVIDIA binaries, outside each test's own directories


@pytest.fixture(scope="module", autouse=True)
def driver_root() -> Iterator[pathlib.Path]:
    with short_tmpdir("start-driver-") as path:
        _DRIVER_ROOT[:] = [fake_driver_root(path)]
        yield _DRIVER_ROOT[0]


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    with short_tmpdir("start-") as path:
        yield path


class Failed:
    def __init__(self, proc: subprocess.CompletedProcess[str]) -> None:
        self.code = proc.returncode
        self.stderr = proc.stderr
        self.lines = [line for line in proc.stderr.splitlines() if line.strip()]


def start(
    root: pathlib.Path,
    server: fakes.apiserver.ApiServer | None,
    *overrides: str,
    log_format: str = "json",
    env: dict[str, str] | None = None,
) -> Failed:
    """Run the agent with working defaults except `overrides` (later flags win); it must exit by itself."""
    flags = {
        "--node-name": NODE,
        "--nvml": MACHINE,
        "--kubelet-root": str(root / "kubelet"),
        "--cdi-root": str(root / "cdi"),
        "--state-dir": str(root / "state"),
        "--metrics-addr": "127.0.0.1:0",
        "--log-format": log_format,
        "--driver-root": str(_DRIVER_ROOT[0]),
    }
    if server is not None:
        flags["--kubeconfig"] = str(server.write_kubeconfig(root / "kubeconfig"))
    args = [a for kv in flags.items() for a in kv] + list(overrides)
    proc = subprocess.run(
        agent_command(*args),
        env={**clean_env(), **(env or {})},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return Failed(proc)


def assert_refused(result: Failed, *words: str, code: int | None = None, log_format: str = "json") -> str:
    """Non-zero exit, no traceback, exactly one line; returns its message."""
    assert result.code != 0, f"the agent did not fail:\n{result.stderr}"
    if code is not None:
        assert result.code == code, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert len(result.lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    line = result.lines[0]
    if log_format == "json":
        record = json.loads(line)
        assert record["level"] == "critical"
        message = str(record["msg"])
    else:
        message = line
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    return message


# --- kubeconfig -----------------------------------------------------------------------------------------


def test_missing_kubeconfig(root: pathlib.Path) -> None:
    message = assert_refused(start(root, None, "--kubeconfig", str(root / "nope")), "kubeconfig", "does not exist")
    assert str(root / "nope") in message


def test_garbled_kubeconfig(root: pathlib.Path) -> None:
    for text in (":: not yaml [", "just: a map\n", "- a\n- list\n", "\x00\x01binary"):
        (root / "garbled").write_text(text)
        assert_refused(start(root, None, "--kubeconfig", str(root / "garbled")), "kubeconfig", "not usable")


def test_kubeconfig_that_is_a_directory(root: pathlib.Path) -> None:
    assert_refused(start(root, None, "--kubeconfig", str(root)), "kubeconfig", "is not a file")


def test_no_kubeconfig_outside_a_cluster(root: pathlib.Path) -> None:
    message = assert_refused(start(root, None), "no kubeconfig given", "--kubeconfig")
    assert "KUBECONFIG" in message


def test_text_format_fatal_line_is_one_line_too(root: pathlib.Path) -> None:
    result = start(root, None, "--kubeconfig", str(root / "nope"), log_format="text")
    message = assert_refused(result, "CRITICAL", "does not exist", log_format="text")
    assert message.split()[2] == "CRITICAL"


# --- directories ----------------------------------------------------------------------------------------


def test_state_dir_that_is_a_file(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    (root / "file").write_text("x")
    assert_refused(start(root, server, "--state-dir", str(root / "file")), "--state-dir", "is not a directory", code=2)


def test_state_dir_under_proc(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    assert_refused(start(root, server, "--state-dir", "/proc/gpu-dra-agent"), "--state-dir", "/proc", code=2)
    assert_refused(start(root, server, "--state-dir", "/proc/self"), "--state-dir", "/proc", code=2)


@contextlib.contextmanager
def read_only_dir(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A directory writes to fail in: mode 0555 for a normal user; root ignores modes, so a read-only tmpfs."""
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield path
        finally:
            path.chmod(0o755)
        return
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)],
            check=False,
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("running as root without mount(8): no way to make a read-only directory")
    if mounted.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=False)


def test_read_only_state_dir(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    with read_only_dir(root / "ro") as ro:
        assert_refused(start(root, server, "--state-dir", str(ro)), "cannot write to --state-dir", code=2)
        assert_refused(start(root, server, "--state-dir", str(ro / "sub")), "cannot create --state-dir", code=2)


def test_read_only_kubelet_root(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    with read_only_dir(root / "ro") as ro:
        assert_refused(start(root, server, "--kubelet-root", str(ro)), "--kubelet-root", "Read-only", code=2)


def test_cdi_root_that_is_a_file_or_read_only(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    (root / "file").write_text("x")
    assert_refused(start(root, server, "--cdi-root", str(root / "file")), "--cdi-root", "is not a directory", code=2)
    with read_only_dir(root / "ro") as ro:
        assert_refused(start(root, server, "--cdi-root", str(ro)), "cannot write to --cdi-root", code=2)


# --- sockets --------------------------------------------------------------------------------------------


def test_socket_path_over_the_unix_limit(server: fakes.apiserver.ApiServer) -> None:
    with short_tmpdir("s-") as root:
        deep = root / ("k" * 90)
        message = assert_refused(start(root, server, "--kubelet-root", str(deep)), "unix sockets", code=2)
        assert "--kubelet-root" in message
        assert not deep.exists(), "refused, yet it created the kubelet root"


def test_a_file_where_the_socket_goes(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    sock = root / "kubelet" / "plugins" / DRIVER / "dra.sock"
    sock.parent.mkdir(parents=True)
    sock.write_text("someone's data")
    assert_refused(start(root, server), str(sock), "is not a socket", code=2)
    assert sock.read_text() == "someone's data"


# --- addresses ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--metrics-addr", "--healthcheck-addr"])
@pytest.mark.parametrize("value", ["9400", "localhost:http", ":99999", "127.0.0.1:-1", "no.such.host.invalid:9400"])
def test_bad_listen_address(root: pathlib.Path, server: fakes.apiserver.ApiServer, flag: str, value: str) -> None:
    assert_refused(start(root, server, flag, value), flag, code=2)


@pytest.mark.parametrize("flag", ["--metrics-addr", "--healthcheck-addr"])
def test_taken_listen_address(root: pathlib.Path, server: fakes.apiserver.ApiServer, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert_refused(start(root, server, flag, address), flag, address, "in use", code=2)


# --- flags ----------------------------------------------------------------------------------------------


def test_log_format_xml_from_the_environment(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    """argparse checks choices of a flag given, not of a default taken from LOG_FORMAT."""
    proc_args = agent_command("--node-name", NODE, "--nvml", MACHINE)
    result = Failed(
        subprocess.run(
            proc_args, env={**clean_env(), "LOG_FORMAT": "xml"}, cwd=REPO, capture_output=True, text=True, check=False
        )
    )
    assert_refused(result, "--log-format", "xml", "LOG_FORMAT", "json, text", code=2, log_format="text")


def test_log_format_xml_flag(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    result = start(root, server, "--log-format", "xml")
    assert_refused(result, "--log-format", "invalid choice: 'xml'", "--help", code=2, log_format="text")


def test_a_bad_flag_value_is_one_line_of_usage_error(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    result = start(root, server, "--resync-interval", "soon")
    assert_refused(result, "gpu-dra-agent node", "--resync-interval", "invalid float value", code=2, log_format="text")


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "-inf"])
def test_resync_interval_must_be_positive_and_finite(
    root: pathlib.Path, server: fakes.apiserver.ApiServer, value: str
) -> None:
    assert_refused(start(root, server, f"--resync-interval={value}"), "--resync-interval", "positive", code=2)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--node-name", "Node_A"),
        ("--node-name", "node a"),
        ("--node-name", "-node"),
        ("--node-name", "n" * 254),
        ("--node-name", "../../etc"),
        ("--driver-name", "GPU.nvidia.com"),
        ("--driver-name", "gpu/nvidia"),
        ("--driver-name", "a" * 64),
    ],
)
def test_names_follow_the_api_dns_rules_before_any_write(
    root: pathlib.Path, server: fakes.apiserver.ApiServer, flag: str, value: str
) -> None:
    before = len(server.store.events_after(0))
    assert_refused(start(root, server, f"{flag}={value}"), flag, "DNS subdomain", code=2)
    assert len(server.store.events_after(0)) == before, "refused, yet it wrote to the API"
    assert not (root / "state").exists() and not (root / "kubelet").exists()


def test_negative_xid(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    assert_refused(start(root, server, "--additional-xids-to-ignore", "13,-5"), "--additional-xids-to-ignore", code=2)


# --- driver root ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", ["nvidia-smi", "nvidia-cuda-mps-control"])
def test_a_driver_root_without_the_binaries_is_one_line_and_exit_2(
    root: pathlib.Path, server: fakes.apiserver.ApiServer, missing: str
) -> None:
    """The binaries sharing and MIG resets run are checked at start, not at the first claim that needs them;
    nothing is written before (no state dir, no socket)."""
    driver_root = fake_driver_root(root / "other")
    (driver_root / "usr/bin" / missing).unlink()
    message = assert_refused(start(root, server, "--driver-root", str(driver_root)), "--driver-root", code=2)
    assert message.startswith(
        f"gpu-dra-agent node: --driver-root {driver_root}: {missing} not found (looked in {driver_root}/usr/bin,"
    )
    assert "NVIDIA_DRIVER_ROOT" in message
    assert not (root / "state").exists()
    empty = root / "empty"
    empty.mkdir()
    message = assert_refused(start(root, server, "--driver-root", str(empty)), code=2)
    assert "nvidia-smi and nvidia-cuda-mps-control not found" in message
    message = assert_refused(start(root, server, "--driver-root", str(root / "nope")), code=2)
    assert message.startswith(f"gpu-dra-agent node: --driver-root {root / 'nope'} is not a directory")


# --- directory modes ------------------------------------------------------------------------------------


def test_created_directories_get_their_modes_whatever_the_umask(
    root: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    """Tried with umask 0o077 and 0o000: the state dir is private, the CDI root readable by the container
    runtime, the kubelet plugin directories as the kubelet makes its own."""
    for umask in (0o077, 0o000):
        base = root / f"umask-{umask:o}"
        base.mkdir()
        daemon = Daemon(
            base, server.write_kubeconfig(base / "kubeconfig"), extra_args=("--driver-root", str(_DRIVER_ROOT[0]))
        )
        previous = os.umask(umask)
        try:
            daemon.start()
        finally:
            os.umask(previous)
        try:
            daemon.wait_serving()
            assert daemon.terminate() == 0
        finally:
            daemon.close()
        modes = {
            p.relative_to(base).as_posix(): oct(stat.S_IMODE(p.stat().st_mode)) for p in base.rglob("*") if p.is_dir()
        }
        assert modes == {
            "state": "0o700",
            "cdi": "0o755",
            "kubelet": "0o755",
            "kubelet/plugins": "0o755",
            f"kubelet/plugins/{DRIVER}": "0o750",
            "kubelet/plugins_registry": "0o750",
        }, f"umask {umask:o}"


def test_an_existing_directory_keeps_its_mode(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    (root / "state").mkdir()
    (root / "state").chmod(0o711)
    daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
    with running(daemon):
        pass
    assert stat.S_IMODE((root / "state").stat().st_mode) == 0o711


# --- the driver root ------------------------------------------------------------------------------------


def test_a_driver_root_of_another_version_is_refused(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    from fakes.nvml.binaries import install_driver_root

    install_driver_root(root / "driver-root", version="535.104.05")  # the fake NVML reports 550.54.15
    assert_refused(
        start(root, server, "--driver-root", str(root / "driver-root")),
        "libcuda.so.535.104.05",
        "NVML reports driver 550.54.15",
        code=2,
    )


def test_host_driver_root_must_be_absolute(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    assert_refused(start(root, server, "--host-driver-root", "run/nvidia/driver"), "--host-driver-root", code=2)


# --- consumable shares ----------------------------------------------------------------------------------


def test_consumable_shares_with_partitionable_devices_is_refused(
    root: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    result = start(root, server, "--consumable-shares", "memory", "--partitionable-devices")
    assert_refused(result, "--consumable-shares=memory cannot be combined with --partitionable-devices", code=2)


def test_a_bad_consumable_shares_value_from_the_environment(
    root: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    result = start(root, server, env={"CONSUMABLE_SHARES": "half"})
    assert_refused(result, "--consumable-shares must be one of disabled, memory, unlimited", "'half'", code=2)


# --- the GPU driver off (a ComputeDomains-only install) ---------------------------------------------------


def test_neither_driver_on_is_refused(root: pathlib.Path, server: fakes.apiserver.ApiServer) -> None:
    """Tried: --no-gpus without --compute-domains, and GPUS=false from the environment (the DaemonSet's way):
    the agent would serve nothing, so it says so and exits 2 before making any directory."""
    assert_refused(start(root, server, "--no-gpus"), "--no-gpus needs --compute-domains", code=2)
    assert_refused(start(root, server, env={"GPUS": "false"}), "--no-gpus needs --compute-domains", code=2)
    assert not (root / "state").exists() and not (root / "kubelet").exists()


def test_gpu_settings_with_the_gpu_driver_off_are_refused(
    root: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    """Tried: --no-gpus --compute-domains with settings only the GPU driver reads (the arbiter's reservation
    address, consumable shares): refused by name instead of silently doing nothing."""
    result = start(
        root,
        server,
        "--no-gpus",
        "--compute-domains",
        "--imex-address",
        "127.0.0.1",
        "--reservation-addr",
        "127.0.0.1:0",
        "--consumable-shares",
        "memory",
    )
    assert_refused(result, "--reservation-addr, --consumable-shares configure the GPU driver", code=2)


def test_an_unreadable_compute_domain_checkpoint_is_a_startup_failure_it_names(
    root: pathlib.Path, server: fakes.apiserver.ApiServer
) -> None:
    """Tried: the compute-domain plugin's checkpoint garbled (a disk error, a hand edit). Before, the agent said it
    as a bug of its own ("failed: CheckpointCorrupt: ...", the traceback at debug level); now, as for the GPU
    claims' checkpoint, it stops what it started and its last line, a critical one, says which file and what to
    do."""
    checkpoint = root / "state" / "compute-domains" / "checkpoint.json"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_text("{not json")
    result = start(root, server, "--compute-domains", "--imex-address", "127.0.0.1")
    assert result.code == 1 and "Traceback" not in result.stderr, result.stderr
    last = json.loads(result.lines[-1])  # the GPU driver started first, and was stopped again
    assert last["level"] == "critical" and last["msg"].startswith(f"gpu-dra-agent node: {checkpoint} cannot be read")
    assert "restart the agent" in last["msg"]
