"""The package metadata uses the current forms, so a first `make venv` builds without setuptools warnings."""

from __future__ import annotations

import pathlib
import tomllib

PYPROJECT = pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_license_is_an_spdx_expression_with_a_setuptools_that_reads_it() -> None:
    project = tomllib.loads(PYPROJECT.read_text())
    assert project["project"]["license"] == "Apache-2.0"  # a table here is deprecated (setuptools >= 77)
    assert "setuptools>=77" in project["build-system"]["requires"]
