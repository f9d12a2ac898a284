#!/bin/bash
# The GPU machine's checks in one run, from the repo root (read-only on the GPU: nothing is reconfigured).
# Python packages the machine lacks travel as wheels in .whl (Python 3.12, x86-64); results go to $OUT.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1 PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
{
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,mig.mode.current,compute_mode --format=csv
    uname -r; python3 --version
    for t in gcc unshare mount chroot ldconfig ldd nvidia-smi nvidia-cdi-hook; do echo "$t: $(command -v $t)"; done
    ldconfig -p | grep -E 'libcuda\.|libnvidia-ml\.'
    ls -la /usr/local/nvidia /usr/local/nvidia/lib64 2>&1 | head -40
    for smi in $(which -a nvidia-smi); do echo "== $smi"; file -L "$smi" 2>&1 || head -c 64 "$smi"; done
    ls /lib/firmware/nvidia 2>&1
    ls -la /run/nvidia-persistenced /run/nvidia-fabricmanager 2>&1
} >"$OUT/machine.txt" 2>&1
python3 -m agent.cli inventory --nvml real --output table >"$OUT/inventory.txt" 2>&1
python3 -m agent.cli inventory --nvml real --output json >"$OUT/inventory.json" 2>"$OUT/inventory.err"
timeout 400 python3 -m pytest -p pytest_timeout -o addopts="-q -ra --strict-markers" -s \
    tests/integration/test_nvml_contract.py tests/unit/test_nvml_discovery.py tests/unit/test_inventory_cli.py \
    tests/gpu 2>&1 | tee "$OUT/pytest.txt"
