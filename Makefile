# Everything a fresh machine needs: Python 3.11+ and make. Targets create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test lint demo proto bench coexistence clean control-plane

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

# kube-apiserver, kube-scheduler, kube-controller-manager 1.37 and etcd 3.6 from tests/controlplane/go.mod into
# ~/.cache/gpu-dra-agent/control-plane (GPU_DRA_AGENT_CACHE moves it); `make test` does this on first use.
control-plane:
	$(PYTHON) -m tests.controlplane.build

bench: $(STAMP)
	$(PY) -m pytest tests/bench -m bench -s -p no:cacheprovider -o addopts=""

# The arbiter beside kube-scheduler on the real control plane, ten full runs (issue 18; ~3 min a run).
coexistence: $(STAMP)
	COEXISTENCE_RUNS=$${COEXISTENCE_RUNS:-10} $(PY) -m pytest tests/bench/test_bench_coexistence.py -m bench -s -p no:cacheprovider -o addopts=""

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
