"""Machine profiles: which GPUs a node has, how they are wired and what MIG layout they start with."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, replace

from fakes.nvml import products as P
from fakes.nvml.products import Product

NVLINK_TO_GPU, NVLINK_TO_SWITCH = 0, 2  # nvmlIntNvLinkDeviceType_t


def bus_id(bus: int, domain: int = 0) -> str:
    """A PCI bus id as NVML prints it: 8-digit domain, upper-case hex."""
    return f"{domain:08X}:{bus:02X}:00.0"


@dataclass(frozen=True)
class NvLink:
    """One active NVLink and what is at its far end."""

    remote_bus_id: str
    remote_type: int = NVLINK_TO_GPU
    remote_pci_device_id: int = 0


@dataclass(frozen=True)
class GpuSpec:
    """One GPU slot of a machine."""

    product: Product
    bus: int
    minor: int
    numa_node: int
    pcie_switch: int  # GPUs behind the same PCIe switch: topology MULTIPLE
    domain: int = 0  # PCI domain
    nvlinks: tuple[NvLink, ...] = ()
    mig_layout: tuple[str, ...] | None = None  # profile names created at start (MIG on), None = MIG off

    @property
    def bus_id(self) -> str:
        return bus_id(self.bus, self.domain)


@dataclass(frozen=True)
class Fabric:
    """NVLink fabric membership (GH200/GB200 multi-node NVLink) reported by GetGpuFabricInfoV."""

    cluster_uuid: bytes  # 16 bytes
    clique_id: int
    state: int = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
    status: int = 0


@dataclass(frozen=True)
class Machine:
    name: str
    description: str
    gpus: tuple[GpuSpec, ...]
    fabric: Fabric | None = None
    driver_version: str = "550.54.15"
    cuda_driver_version: int = 12040

    def gpu_uuid(self, index: int) -> str:
        """'GPU-<uuid4>', stable for a machine name and index so tests can compare across installs."""
        return "GPU-" + str(deterministic_uuid4(f"{self.name}/{index}"))


def deterministic_uuid4(seed: str) -> uuid.UUID:
    return uuid.UUID(int=random.Random(seed).getrandbits(128), version=4)


def _switched(product: Product, buses: list[int], switch_buses: list[int], numa: list[int]) -> tuple[GpuSpec, ...]:
    """GPUs on NVSwitch: every link goes to a switch (remote PCI info names the switch, not a GPU)."""
    return tuple(
        GpuSpec(
            product,
            bus,
            minor=i,
            numa_node=numa[i],
            pcie_switch=i // 2,
            nvlinks=tuple(
                NvLink(bus_id(switch_buses[link % len(switch_buses)]), NVLINK_TO_SWITCH, 0x22A310DE)
                for link in range(product.nvlinks)
            ),
        )
        for i, bus in enumerate(buses)
    )


def _direct(product: Product, buses: list[int], peers: dict[int, list[int]], **kw: list[int]) -> tuple[GpuSpec, ...]:
    """GPUs linked to each other directly (bridges or all-to-all): links are spread evenly over the peers."""
    minors, numa = kw.get("minors", list(range(len(buses)))), kw.get("numa", [0] * len(buses))
    out = []
    for i, bus in enumerate(buses):
        mine = peers.get(i, [])
        links = tuple(
            NvLink(bus_id(buses[mine[link % len(mine)]]), NVLINK_TO_GPU, product.pci_device_id)
            for link in range(product.nvlinks if mine else 0)
        )
        out.append(GpuSpec(product, bus, minors[i], numa[i], pcie_switch=i // 2, nvlinks=links))
    return tuple(out)


def _with_mig(gpus: tuple[GpuSpec, ...], layout: tuple[str, ...], indexes: set[int]) -> tuple[GpuSpec, ...]:
    return tuple(replace(g, mig_layout=layout) if i in indexes else g for i, g in enumerate(gpus))


_DGX_A100_BUSES = [0x07, 0x0F, 0x47, 0x4E, 0x87, 0x90, 0xB7, 0xBD]
_DGX_A100_SWITCHES = [0xC4, 0xC5, 0xC6, 0xC7, 0xC8, 0xC9]  # six NVSwitches, two links from each GPU
_DGX_H100_BUSES = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
_DGX_H100_SWITCHES = [0xE0, 0xE1, 0xE2, 0xE3]  # four NVSwitch chips
_HALVES = [0, 0, 0, 0, 1, 1, 1, 1]
# The GPU Operator's `all-balanced` for H100-80GB, in the order mig-parted creates it (largest first).
ALL_BALANCED_H100_80GB = ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")

# A GB200 NVL72 rack: 18 compute trays ("nodes") of 4 GPUs, every GPU on the rack's NVLink switches, all in one
# fabric (one cluster UUID) and, until a test repartitions it (FakeNvml.set_fabric), one clique.
NVL72_NODES = 18
NVL72_CLUSTER_UUID = deterministic_uuid4("gb200-nvl72/rack-0").bytes
NVL72_CLIQUE_ID = 1
_GB200_DOMAINS = [0x0008, 0x0009, 0x0018, 0x0019]  # each GPU in a PCI domain of its own, as on a compute tray


def nvl72_node(index: int) -> Machine:
    """Node `index` (0-17) of the fake GB200 NVL72 rack: machine `gb200-nvl72-node<NN>`, GPU UUIDs its own."""
    gpus = tuple(
        GpuSpec(
            P.GB200,
            0x01,
            minor=i,
            numa_node=i // 2,
            pcie_switch=i,
            domain=domain,
            nvlinks=tuple(
                NvLink(bus_id(0x10 + link % 9, domain=0x0100), NVLINK_TO_SWITCH, 0x22A310DE)
                for link in range(P.GB200.nvlinks)
            ),
        )
        for i, domain in enumerate(_GB200_DOMAINS)
    )
    return Machine(
        f"gb200-nvl72-node{index:02d}",
        f"GB200 NVL72 compute tray {index} of 18: 4x GB200 on the rack's NVLink fabric (one clique)",
        gpus,
        fabric=Fabric(NVL72_CLUSTER_UUID, clique_id=NVL72_CLIQUE_ID),
    )


MACHINES: dict[str, Machine] = {
    m.name: m
    for m in [
        Machine(
            "dgx-a100-40gb",
            "DGX A100: 8x A100-SXM4-40GB on six NVSwitches (one NVLink domain)",
            _switched(P.A100_SXM4_40GB, _DGX_A100_BUSES, _DGX_A100_SWITCHES, _HALVES),
        ),
        Machine(
            "dgx-a100-80gb",
            "DGX A100 80GB: 8x A100-SXM4-80GB on six NVSwitches (one NVLink domain)",
            _switched(P.A100_SXM4_80GB, _DGX_A100_BUSES, _DGX_A100_SWITCHES, _HALVES),
        ),
        Machine(
            "dgx-h100",
            "DGX H100: 8x H100 80GB HBM3 on NVSwitch (one NVLink domain)",
            _switched(P.H100_SXM5_80GB, _DGX_H100_BUSES, _DGX_H100_SWITCHES, _HALVES),
        ),
        Machine(
            "hgx-h200",
            "HGX H200: 8x H200 141GB on NVSwitch (one NVLink domain)",
            _switched(P.H200_SXM5, _DGX_H100_BUSES, _DGX_H100_SWITCHES, _HALVES),
        ),
        Machine(
            "h100-nvl-x4",
            "4x H100 NVL (PCIe) bridged in pairs 0-1 and 2-3 (two NVLink domains); minor numbers differ from indexes",
            _direct(
                P.H100_NVL,
                [0x21, 0x41, 0xA1, 0xC1],
                {0: [1], 1: [0], 2: [3], 3: [2]},
                minors=[2, 3, 0, 1],
                numa=[0, 0, 1, 1],
            ),
        ),
        Machine(
            "gh200",
            "GH200 Grace Hopper superchip attached to a multi-node NVLink fabric clique",
            (
                GpuSpec(
                    P.GH200_96GB,
                    0x01,
                    minor=0,
                    numa_node=0,
                    pcie_switch=0,
                    domain=0x0009,
                    nvlinks=tuple(
                        NvLink(bus_id(0x10 + link % 2, domain=0x0010), NVLINK_TO_SWITCH, 0x22A310DE)
                        for link in range(P.GH200_96GB.nvlinks)
                    ),
                ),
            ),
            fabric=Fabric(deterministic_uuid4("gh200/fabric").bytes, clique_id=32766),
        ),
        Machine(
            "a100-pcie-x2",
            "2x A100-PCIE-40GB without NVLink bridges, one per CPU socket",
            _direct(P.A100_PCIE_40GB, [0x3B, 0xD8], {}, numa=[0, 1]),
        ),
        Machine(
            "mixed-mig",
            "4x H100 80GB HBM3 linked all-to-all; GPUs 0-1 in MIG mode with the operator's all-balanced layout",
            _with_mig(
                _direct(
                    P.H100_SXM5_80GB,
                    [0x18, 0x2A, 0x9A, 0xAB],
                    {i: [j for j in range(4) if j != i] for i in range(4)},
                    numa=[0, 0, 1, 1],
                ),
                ALL_BALANCED_H100_80GB,
                {0, 1},
            ),
        ),
        Machine(
            "l40s-x2",
            "2x L40S (Ada, not MIG-capable, no NVLink)",
            _direct(P.L40S, [0x4A, 0xCA], {}, numa=[0, 1]),
        ),
        *(nvl72_node(i) for i in range(NVL72_NODES)),
    ]
}


def machine_names() -> list[str]:
    return sorted(MACHINES)


def get_machine(machine: str | Machine) -> Machine:
    if isinstance(machine, Machine):
        return machine
    try:
        return MACHINES[machine]
    except KeyError:
        raise ValueError(f"unknown fake NVML machine {machine!r}; known: {', '.join(machine_names())}") from None
