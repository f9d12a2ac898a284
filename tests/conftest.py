"""Shared test configuration. Area-specific fixtures live in the test modules that use them."""

from __future__ import annotations

import logging
import os
import pathlib
import time
from collections.abc import Iterator

import pytest
from hypothesis import settings

from native.compile import compiled, sources
from tests.controlplane import build

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

# The real control-plane tier (marker `controlplane`): the binary directory, or why the tier is skipped.
# A tier's build outcome: its binary directory, why it is skipped here (str), or how its build broke.
BuildOutcome = pathlib.Path | str | build.BuildError
CONTROL_PLANE_KEY = pytest.StashKey[BuildOutcome]()
STARTUP_KEY = pytest.StashKey[tuple[float, dict[str, float]]]()
BUILD_KEY = pytest.StashKey[str]()
# Whether a session builds missing binaries itself (GPU_DRA_AGENT_BUILD_CONTROL_PLANE=0/1 overrides), and for
# how long at most (GPU_DRA_AGENT_CONTROL_PLANE_BUILD_BUDGET, seconds). A cold build is ~17 CPU-minutes: about
# ten minutes on an idle 2-core machine, an hour on a crowded one; past the budget the tier is skipped, loudly,
# so CI (90 minutes) never times out on it.
BUILD_ON_FIRST_USE = True
BUILD_BUDGET_S = 40 * 60
# The node tier (marker `node`) also needs kubelet, containerd, runc, the CNI plugins and crictl
# (tests/node/build.py; README has the measured times). GPU_DRA_AGENT_NODE_STACK_BUILD_BUDGET (seconds)
# bounds its build the same way.
NODE_STACK_KEY = pytest.StashKey[BuildOutcome]()
NODE_BUILD_BUDGET_S = 20 * 60


# Property tests draw the same examples on every run by default, so CI on a clean clone is reproducible;
# HYPOTHESIS_PROFILE=explore draws fresh ones (and keeps failures in .hypothesis/) to hunt for new cases.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture(autouse=True)
def _root_logging_as_found() -> Iterator[None]:
    """A test that runs a command in-process (`main([...])`) has agent.logs.setup point the root logger at the
    stderr pytest captured for that test; once that capture is closed, any later record (another test's thread)
    would fail to print. Such a handler goes with its test."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    for handler in root.handlers[:]:
        if type(handler) is logging.StreamHandler and handler not in before:  # agent.logs.setup's kind
            root.removeHandler(handler)
    root.setLevel(level)


def pytest_sessionstart(session: pytest.Session) -> None:
    # An extension module is imported ahead of its .py: a core source changed since its compile would not be the
    # code under test. `make test` recompiles first; a bare pytest must not test the old code unawares.
    built = compiled()
    if not built:
        return
    oldest = min(p.stat().st_mtime for p in built)
    changed = [p.name for p in sources() if p.stat().st_mtime > oldest]
    if changed:
        pytest.exit(
            f"agent/arbiter/core was compiled before {', '.join(changed)} last changed: run `make compiled` "
            "(or `python native/compile.py --clean` to run it interpreted)",
            returncode=2,
        )


def pytest_report_header() -> str:
    return "arbiter core: " + ("compiled (mypyc)" if compiled() else "interpreted")


@pytest.fixture(scope="session")
def shared_dir() -> pathlib.Path:
    """`../shared` beside the checkout: reference data (MIG tables, CDI schema, traces)."""
    if not SHARED.is_dir():
        pytest.skip("../shared is not beside this checkout")
    return SHARED


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Build the upstream binaries before the first test when the real tier is selected and they are missing.

    Here rather than in a fixture: a cold build takes many minutes, longer than any per-test timeout. The
    node tier needs the control plane too; its own stack is built after it, when Go's build cache already
    holds most of what the kubelet compiles.
    """
    if any(item.get_closest_marker("controlplane") or item.get_closest_marker("node") for item in items):
        _control_plane(config)
    if any(item.get_closest_marker("node") for item in items):
        control_plane = config.stash.get(CONTROL_PLANE_KEY, None)
        config.stash[NODE_STACK_KEY] = (
            _node_stack(config)
            if isinstance(control_plane, pathlib.Path)
            else "real node tier skipped: it runs beside the real control plane, which is not built"
        )


def _control_plane(config: pytest.Config) -> None:
    ready = build.built()
    if ready is not None:
        config.stash[CONTROL_PLANE_KEY] = ready
        return
    if build.go_command() is None:
        config.stash[CONTROL_PLANE_KEY] = (
            "real control-plane tier skipped: `go` (1.26) is not on PATH to build kube-apiserver "
            f"{build.kubernetes_version()} and etcd {build.etcd_version()} (`make control-plane`)"
        )
        return
    if os.environ.get("GPU_DRA_AGENT_BUILD_CONTROL_PLANE", "1" if BUILD_ON_FIRST_USE else "0") != "1":
        config.stash[CONTROL_PLANE_KEY] = (
            "real control-plane tier skipped: its binaries are not built; `make control-plane` builds them "
            "(or set GPU_DRA_AGENT_BUILD_CONTROL_PLANE=1 to build on first use)"
        )
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    log = build.binary_dir().parent / f"{build.binary_dir().name}.build.log"
    if reporter is not None:
        reporter.write_line(
            f"building the upstream control plane {build.kubernetes_version()} for the real tier "
            f"(first use; cold this takes many minutes; log: {log})"
        )
    started = time.monotonic()
    budget = float(os.environ.get("GPU_DRA_AGENT_CONTROL_PLANE_BUILD_BUDGET", BUILD_BUDGET_S))
    try:
        config.stash[CONTROL_PLANE_KEY] = build.build(log, budget)
    except build.BuildTimeout as error:  # too slow here, not broken: skip the tier and say so
        config.stash[CONTROL_PLANE_KEY] = f"real control-plane tier skipped: {error}"
        return
    except build.BuildError as error:  # the real tier's tests fail with it; the rest of the suite runs
        config.stash[CONTROL_PLANE_KEY] = error
        return
    config.stash[BUILD_KEY] = f"built in {time.monotonic() - started:.0f}s"


def _node_stack(config: pytest.Config) -> BuildOutcome:
    """The node tier's binary directory, or why the tier is skipped (str) or broken (BuildError)."""
    from tests.node import build as node_build
    from tests.node import images

    if os.geteuid() != 0:
        return "real node tier skipped: it needs root (device nodes, cgroups, containerd)"
    if why := images.available():
        return f"real node tier skipped: {why}"
    ready = node_build.built()
    if ready is not None:
        return ready
    if why := node_build.missing_prerequisite():
        return f"real node tier skipped: {why}"
    if os.environ.get("GPU_DRA_AGENT_BUILD_CONTROL_PLANE", "1" if BUILD_ON_FIRST_USE else "0") != "1":
        return "real node tier skipped: its binaries are not built; `make node-stack` builds them"
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"building the node stack for the real node tier (first use; log beside {node_build.binary_dir()})"
        )
    budget = float(os.environ.get("GPU_DRA_AGENT_NODE_STACK_BUILD_BUDGET", NODE_BUILD_BUDGET_S))
    try:
        return node_build.build(budget_s=budget)
    except build.BuildTimeout as error:
        return f"real node tier skipped: {error}"
    except build.BuildError as error:
        return error


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    node = config.stash.get(NODE_STACK_KEY, None)
    if isinstance(node, str):
        terminalreporter.write_line(node, yellow=True)
    elif isinstance(node, build.BuildError):
        terminalreporter.write_line(f"real node tier failed to build: {node}", red=True)
    elif node is not None:
        terminalreporter.write_line(f"real node tier: {node}")
    outcome = config.stash.get(CONTROL_PLANE_KEY, None)
    if outcome is None:
        return
    if isinstance(outcome, str):
        terminalreporter.write_line(outcome, yellow=True)
        return
    if isinstance(outcome, build.BuildError):
        terminalreporter.write_line(f"real control-plane tier failed to build: {outcome}", red=True)
        return
    line = f"real control-plane tier: {outcome}"
    if BUILD_KEY in config.stash:
        line += f" ({config.stash[BUILD_KEY]})"
    if STARTUP_KEY in config.stash:
        total, parts = config.stash[STARTUP_KEY]
        line += f"; started in {total:.1f}s (" + ", ".join(f"{k} {v:.1f}s" for k, v in parts.items()) + ")"
    terminalreporter.write_line(line)


def built_binaries(request: pytest.FixtureRequest, key: pytest.StashKey[BuildOutcome], tier: str) -> pathlib.Path:
    """The binary directory collection stashed under `key`; skips (not built here, and why) or fails (the build
    broke) the test otherwise."""
    binaries = request.config.stash.get(key, None)
    if isinstance(binaries, str):
        pytest.skip(binaries)
    if isinstance(binaries, build.BuildError):
        pytest.fail(f"the {tier} cannot run: {binaries}")
    if binaries is None:
        pytest.fail(f"the {tier} was selected but no build was attempted")
    return binaries


@pytest.fixture(scope="session")
def control_plane_binaries(request: pytest.FixtureRequest) -> pathlib.Path:
    """Where the real control plane's binaries are (build or skip decided in tests/conftest.py), for tests
    that start control planes of their own (other flags, one per run)."""
    return built_binaries(request, CONTROL_PLANE_KEY, "real control-plane tier")
