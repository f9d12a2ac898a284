# Everything a fresh machine needs: Python 3.11+ and make. Targets create .venv themselves.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: venv compiled test check demo proto bench trials coexistence clean control-plane container-tools node-stack node-deps image image-tools

venv: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# the test world (fakes, tests) is not in the product's wheel: the test venv finds it in the checkout
	$(PY) -c 'import site, pathlib; pathlib.Path(site.getsitepackages()[0], "gpu_dra_agent_test_world.pth").write_text(str(pathlib.Path.cwd()) + "\n")'
	touch $(STAMP)

# The arbiter's core compiled with mypyc (native/compile.py): the same source run as C, its cycle about 1.6x
# faster (DESIGN.md). Rebuilt whenever a core source changes; where it cannot be built (no C compiler or Python
# headers) the core runs interpreted, with the same decisions.
CORE_SOURCES := $(wildcard agent/arbiter/core/*.py)
COMPILED := $(VENV)/.core-compiled

compiled: $(COMPILED)

$(COMPILED): $(STAMP) $(CORE_SOURCES) native/compile.py
	@if $(PY) native/compile.py > $(VENV)/compile.log 2>&1; then touch $@; echo "arbiter core compiled (mypyc)"; \
	else $(PY) native/compile.py --clean; \
	  echo "the arbiter core could not be compiled (see $(VENV)/compile.log): it runs interpreted"; fi

test: $(STAMP) $(COMPILED) container-tools node-deps image-tools
	$(PY) -m pytest

# podman, Debian's runc and a static busybox for tests/integration/test_cdi_container.py (a claim's CDI spec
# applied by a real container engine); where they cannot be installed, those tests skip and say why.
container-tools:
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v busybox >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -q podman runc busybox-static >/dev/null; }; } || \
	  echo "podman/runc/busybox-static not installed: the CDI container tests will skip"

# The agent's OCI image from Debian's packages and PyPI alone (daemonset/image/build.py, as root): the product
# and the test image (plus the NVML fake) as archives in build/image for `ctr -n k8s.io images import`,
# `podman load -i` or `docker load -i`. Reproducible; the Debian root and the locked wheels are cached.
image: $(STAMP) image-tools
	$(PY) daemonset/image/build.py

# mmdebstrap from Debian for the image's root (tests/integration/test_image.py skips without it).
image-tools:
	@command -v mmdebstrap >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive \
	      apt-get install -y -q --no-install-recommends mmdebstrap >/dev/null; }; } || \
	  echo "mmdebstrap not installed: the image tests will skip"

# What keeps the tree as it is meant to be, run by .ci/run before the tests: formatting, lint, strict types on
# agent/, the import contracts (pyproject.toml) and generated protos that match their sources.
check: $(STAMP)
	$(VENV)/bin/ruff format --check agent fakes tests proto native daemonset
	$(VENV)/bin/ruff check agent fakes tests proto native daemonset
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	$(PY) proto/generate.py --check

demo: $(STAMP) $(COMPILED)
	$(PY) -m fakes.demo

proto: $(STAMP)
	$(PY) proto/generate.py

# kube-apiserver, kube-scheduler, kube-controller-manager 1.37 and etcd 3.6 from tests/controlplane/go.mod into
# ~/.cache/gpu-dra-agent/control-plane (GPU_DRA_AGENT_CACHE moves it); `make test` does this on first use.
control-plane:
	$(PYTHON) -m tests.controlplane.build

# kubelet 1.37, containerd 2.4 (+ctr, shim), runc 1.5 (seccomp), CNI plugins and crictl from tests/node/*/go.mod
# into ~/.cache/gpu-dra-agent/node-stack; `make test` does this on first use (tests marked `node`).
node-stack: node-deps
	$(PYTHON) -m tests.node.build

# What the node tier needs from Debian beyond Go: libseccomp's headers (runc) and a static busybox (images).
# Installed only as root on Debian/Ubuntu and only when missing; elsewhere the tier is skipped with the reason.
node-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	   { [ ! -e /usr/include/seccomp.h ] || ! dpkg -s busybox-static >/dev/null 2>&1; }; then \
	  { apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -q --no-install-recommends libseccomp-dev busybox-static >/dev/null; } || \
	  echo "node-deps: apt-get install libseccomp-dev busybox-static failed; the node tier will be skipped"; \
	fi

bench: $(STAMP) $(COMPILED)
	$(PY) -m pytest tests/bench -m bench -s -p no:cacheprovider -o addopts=""

trials: $(STAMP) $(COMPILED)  # TRIALS=200 for the issue's count; slow (minutes)
	$(PY) -m pytest tests/bench -m trials -s -p no:cacheprovider -o addopts="" --timeout=0

# The arbiter beside kube-scheduler on the real control plane, ten full runs (issue 18; ~3 min a run).
coexistence: $(STAMP) $(COMPILED)
	COEXISTENCE_RUNS=$${COEXISTENCE_RUNS:-10} $(PY) -m pytest tests/bench/test_bench_coexistence.py -m bench -s -p no:cacheprovider -o addopts=""

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build
	find agent -name '*.so' -delete
