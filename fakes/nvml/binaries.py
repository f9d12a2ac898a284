"""The fake NVIDIA binaries as executables: a fake driver root whose usr/bin holds `nvidia-smi` and
`nvidia-cuda-mps-control` (put that directory on PATH, or pass the root as the agent's --driver-root), beside
the rest of a driver install (fakes.nvml.driver_files: libraries, other binaries, firmware, ld.so.cache).

They run this checkout's fakes with this interpreter and act on the GPUs of FAKE_NVML_STATE, which they
inherit from whoever runs them (the agent, a test, a shell).
"""

from __future__ import annotations

import pathlib
import sys

from fakes.nvml.driver_files import VERSION, install_driver_files

REPO = pathlib.Path(__file__).resolve().parents[2]
BINARIES = {
    "nvidia-smi": "fakes.nvml.smi",
    "nvidia-cuda-mps-control": "fakes.nvml.mps",
    "nvidia-imex": "fakes.nvml.imex",
    "nvidia-imex-ctl": "fakes.nvml.imexctl",
}
BIN_DIR = "usr/bin"
# The character devices the NVIDIA kernel modules register, as /proc/devices lists them (majors vary by host):
# `<root>/proc/devices` stands in for the host's /proc/devices (the agent's --proc-devices).
PROC_DEVICES = "proc/devices"
IMEX_CHANNELS_MAJOR = 234
_PROC_DEVICES_TEXT = f"""Character devices:
  1 mem
  4 /dev/vc/0
195 nvidia-frontend
{IMEX_CHANNELS_MAJOR} nvidia-caps-imex-channels
236 nvidia-caps
237 nvidia-uvm
508 nvidia-nvswitch

Block devices:
  8 sd
"""


def install_driver_root(
    root: pathlib.Path, python: str = sys.executable, *, version: str = VERSION, layout: str = "host"
) -> pathlib.Path:
    """Write the fake binaries into `<root>/usr/bin` (created) and the driver's other files of `version`
    in `layout` (see fakes.nvml.driver_files); returns the usr/bin directory."""
    install_driver_files(pathlib.Path(root), version, layout)
    bin_dir = pathlib.Path(root) / BIN_DIR
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, module in BINARIES.items():
        path = bin_dir / name
        path.write_text(
            f"#!{python}\n"
            f'"""Fake {name} (gpu-dra-agent fakes)."""\n'
            "import sys\n"
            f"sys.path.insert(0, {str(REPO)!r})\n"
            f"from {module} import main\n"
            "sys.exit(main())\n"
        )
        path.chmod(0o755)
    proc_devices = pathlib.Path(root) / PROC_DEVICES
    proc_devices.parent.mkdir(parents=True, exist_ok=True)
    proc_devices.write_text(_PROC_DEVICES_TEXT)
    return bin_dir
