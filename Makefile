# Everything a fresh machine needs: Python 3.11+ and make. Targets create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test lint demo proto bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check agent fakes tests proto
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

demo: $(STAMP)
	$(VENV)/bin/gpu-dra-agent demo

proto: $(STAMP)
	$(PY) proto/generate.py

bench: $(STAMP)
	$(PY) -m pytest tests/bench -m bench -s -p no:cacheprovider -o addopts=""

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
