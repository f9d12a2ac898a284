"""The compiled core (`make compiled`: mypyc, native/compile.py) decides exactly as its source does: one full
cycle over the same synthetic snapshot, compiled in this process and interpreted in a subprocess that imports a
copy of the core's `.py` files alone, compared by a digest of every pod's decision."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from agent.arbiter.core import cycle
from agent.arbiter.core.model import Placement
from tests.bench.test_bench_arbiter_scale import _cycle, _cycle_in_subprocess, synthetic

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(cycle.__file__.endswith(".py"), reason="the core runs interpreted here (see `make compiled`)")
@pytest.mark.parametrize("gpu", ["fgd", "binpack"])
def test_the_compiled_core_decides_as_its_source_does(tmp_path: Path, gpu: str) -> None:
    sources = [
        ROOT / "agent" / "__init__.py",
        ROOT / "agent" / "arbiter" / "__init__.py",
        *(ROOT / "agent" / "arbiter" / "core").glob("*.py"),
    ]
    for source in sources:
        copy = tmp_path / source.relative_to(ROOT)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, copy)
    size = (300, 1_200, 3_000)  # nodes, running pods, pending pods: reclaim and preemption both happen
    interpreted = _cycle_in_subprocess(tmp_path, *size, gpu)
    compiled = _cycle(dataclasses.replace(synthetic(*size), placement=Placement(gpu=gpu)))
    assert compiled["pods placed"] > 0 and compiled["pods evicted"] > 0
    assert (compiled["pods placed"], compiled["pods evicted"], compiled["decisions"]) == (
        interpreted["pods placed"],
        interpreted["pods evicted"],
        interpreted["decisions"],
    )
