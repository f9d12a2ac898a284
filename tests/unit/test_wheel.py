"""The product's wheel, built as `pip wheel .` builds it: `agent` alone, no test world (fakes, tests), no
top-level `proto` (which would shadow proto-plus), and the research libraries only behind the `simulation` extra."""

from __future__ import annotations

import email
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    # a copy of what the build reads: setuptools builds in the source tree, and the checkout's build/ may hold
    # files of an older layout that would end up in the wheel
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "agent", source / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("gpu_dra_agent-*.whl")
    return zipfile.ZipFile(built)


def test_the_wheel_holds_agent_alone(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/", 1)[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"agent"}
    assert not [n for n in wheel.namelist() if n.startswith(("agent/demo/", "agent/commands/demo"))]


def test_the_wheel_carries_what_the_agent_reads_at_run_time(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    assert "agent/py.typed" in names
    assert "agent/simulation/snapshot/snapshot.schema.json" in names
    assert any(n.startswith("agent/_proto/") and n.endswith("_pb2.py") for n in names)


def test_research_libraries_are_behind_the_simulation_extra(wheel: zipfile.ZipFile) -> None:
    (meta,) = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
    requires = email.message_from_bytes(wheel.read(meta)).get_all("Requires-Dist") or []
    plain = [r for r in requires if "extra ==" not in r]
    assert not [r for r in plain if r.startswith(("numpy", "jsonschema", "kubernetes", "pytest"))], plain
    assert any(r.startswith("numpy") and 'extra == "simulation"' in r for r in requires)
