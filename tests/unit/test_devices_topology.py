"""NVLink domains from the peer graph: direct links, NVSwitches, fabric cliques, lone GPUs."""

from __future__ import annotations

from agent.devices.model import FabricInfo, Gpu
from agent.devices.topology import assign_nvlink_domains
from tests.factories import h100


def gpu(minor: int, peers: tuple[str, ...] = (), fabric: FabricInfo | None = None) -> Gpu:
    return h100(
        minor,
        uuid=f"GPU-{minor:04d}",
        product_name="NVIDIA H100 NVL",
        memory_bytes=94 * 2**30,
        pci_bus_id=bus(minor),
        pci_device_id=0x232110DE,
        nvlink_peers=peers,
        fabric=fabric,
    )


def bus(minor: int) -> str:
    return f"0000:{0x10 + minor:02x}:00.0"


def test_bridged_pairs_form_two_domains() -> None:
    gpus = [gpu(0, (bus(1),)), gpu(1, (bus(0),)), gpu(2, (bus(3).upper(),)), gpu(3, (bus(2),))]
    stamped, domains = assign_nvlink_domains(gpus)
    assert [d.gpu_minors for d in domains] == [(0, 1), (2, 3)]
    assert stamped[0].nvlink_domain == stamped[1].nvlink_domain != stamped[2].nvlink_domain
    assert stamped[2].nvlink_domain == stamped[3].nvlink_domain
    assert not any(d.fabric for d in domains)


def test_gpus_on_the_same_nvswitch_share_a_domain() -> None:
    switches = ("0000:c0:00.0", "0000:c1:00.0")
    gpus = [gpu(i, switches) for i in range(8)]
    stamped, domains = assign_nvlink_domains(gpus)
    assert [d.gpu_minors for d in domains] == [tuple(range(8))]
    assert len({g.nvlink_domain for g in stamped}) == 1


def test_a_gpu_without_nvlink_is_its_own_domain() -> None:
    stamped, domains = assign_nvlink_domains([gpu(0), gpu(1)])
    assert [d.gpu_minors for d in domains] == [(0,), (1,)]
    assert stamped[0].nvlink_domain != stamped[1].nvlink_domain


def test_domain_ids_do_not_depend_on_discovery_order() -> None:
    gpus = [gpu(0, (bus(1),)), gpu(1, (bus(0),)), gpu(2)]
    forward, _ = assign_nvlink_domains(gpus)
    backward, _ = assign_nvlink_domains(list(reversed(gpus)))
    assert {g.uuid: g.nvlink_domain for g in forward} == {g.uuid: g.nvlink_domain for g in backward}


def test_a_fabric_clique_names_the_domain_across_nodes() -> None:
    fabric = FabricInfo("5f4e3d2c-1b0a-4000-8000-00000000abcd", 3)
    stamped, domains = assign_nvlink_domains([gpu(0, fabric=fabric)])
    assert stamped[0].nvlink_domain == "5f4e3d2c-1b0a-4000-8000-00000000abcd.3"
    assert domains[0].fabric
