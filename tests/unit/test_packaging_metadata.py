"""The package metadata uses the current forms, so a first `make venv` builds without setuptools warnings."""

from __future__ import annotations

import pathlib
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it() -> None:
    project = tomllib.loads(PYPROJECT.read_text())
    assert project["project"]["license"] == "Apache-2.0"  # a table here is deprecated (setuptools >= 77)
    assert "setuptools>=77" in project["build-system"]["requires"]


README = PYPROJECT.with_name("README.md")


def test_readme_runs_the_fakes_with_the_venvs_interpreter() -> None:
    import re

    text = README.read_text()
    found = re.finditer(r"(\S*)python3? -m fakes\.\w+", text)
    bare = [m.group(0) for m in found if not m.group(1).endswith(".venv/bin/")]
    assert bare == []


def test_readme_names_only_files_the_repository_has() -> None:
    import re

    text = README.read_text()
    for path in re.findall(r"simulate (\S+\.json)", text):
        assert (PYPROJECT.parent / path).is_file(), path
