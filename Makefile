# Everything a fresh machine needs: Python 3.11+ and make. Targets create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv test lint demo proto bench clean control-plane container-tools

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

test: $(STAMP) container-tools
	$(PY) -m pytest

# podman, Debian's runc and a static busybox for tests/integration/test_cdi_container.py (a claim's CDI spec
# applied by a real container engine); where they cannot be installed, those tests skip and say why.
container-tools:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v busybox >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -q podman runc busybox-static >/dev/null; }; } || \
	  echo "podman/runc/busybox-static not installed: the CDI container tests will skip"

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

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
