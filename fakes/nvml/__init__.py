"""A fake libnvidia-ml behind `pynvml.nvmlLib`: the real pynvml wrappers run unchanged against machine
profiles built from data/mig-profiles.json, with NVML's MIG rules, NVLink, fabric info, events and faults.

    with fakes.nvml.install("dgx-h100") as fake:
        pynvml.nvmlInit()
        ...
        fake.inject_xid(0, 48)
"""

from fakes.nvml.control import FakeNvml, install, installed, uninstall
from fakes.nvml.machines import MACHINES, Machine, machine_names
from fakes.nvml.state import GpuBusy

__all__ = ["MACHINES", "FakeNvml", "GpuBusy", "Machine", "install", "installed", "machine_names", "uninstall"]
