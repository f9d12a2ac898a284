"""Discovery against every fake machine: what NVML reports must land in the inventory unchanged."""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections import Counter
from collections.abc import Iterator

import pynvml
import pytest

import fakes.nvml
from agent.devices.geometry import PlacedProfile, is_valid_layout
from agent.devices.model import Inventory
from agent.devices.names import GpuName, MigName, parse_device_name
from agent.nvml.discovery import derive_profile_name
from agent.nvml.discovery import discover as discover_now
from agent.nvml.errors import GpuLost, NvmlUnavailable, translate
from agent.nvml.session import nvml_session
from agent.nvml.source import InvalidNvmlSpec, NvmlSource, open_nvml, parse_nvml_spec
from fakes.nvml import MACHINES, machine_names

H100_PLACEMENTS = {
    "1g.10gb": 7,
    "1g.10gb+me": 7,
    "1g.20gb": 4,
    "2g.20gb": 3,
    "3g.40gb": 2,
    "4g.40gb": 1,
    "7g.80gb": 1,
}
H100_INFO_IDS = {
    "1g.10gb": 19,
    "1g.10gb+me": 20,
    "1g.20gb": 15,
    "2g.20gb": 14,
    "3g.40gb": 9,
    "4g.40gb": 5,
    "7g.80gb": 0,
}
BUS_ID = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@pytest.fixture
def nvml(request: pytest.FixtureRequest) -> Iterator[NvmlSource]:
    with open_nvml(f"fake:{request.param}") as source:
        yield source


def discover(machine: str) -> Inventory:
    with open_nvml(f"fake:{machine}") as source:
        return source.discover()


@pytest.mark.parametrize("machine", machine_names())
def test_every_machine_is_discovered_as_configured(machine: str) -> None:
    spec = MACHINES[machine]
    inv = discover(machine)
    assert [g.index for g in inv.gpus] == list(range(len(spec.gpus)))
    assert [g.minor for g in inv.gpus] == [s.minor for s in spec.gpus]
    assert [g.numa_node for g in inv.gpus] == [s.numa_node for s in spec.gpus]
    assert [g.uuid for g in inv.gpus] == [spec.gpu_uuid(i) for i in range(len(spec.gpus))]
    assert inv.driver_version == spec.driver_version
    assert re.fullmatch(r"\d+\.\d+", inv.cuda_driver_version)
    for g, s in zip(inv.gpus, spec.gpus, strict=True):
        assert BUS_ID.match(g.pci_bus_id)
        assert g.pci_bus_id == s.bus_id.lower()[4:]
        assert parse_device_name(f"gpu-{g.minor}") == GpuName(g.minor)
        assert g.pcie_root and g.pcie_root.startswith("pci")
        assert g.mig_capable == bool(g.mig_profiles)
        ids = [p.gi_profile_id for p in g.mig_profiles]
        assert len(ids) == len(set(ids))
        for p in g.mig_profiles:
            assert p.placements and all(pl.size == p.memory_slices and pl.start + pl.size <= 8 for pl in p.placements)
    covered = sorted(m for d in inv.nvlink_domains for m in d.gpu_minors)
    assert covered == sorted(g.minor for g in inv.gpus)
    for d in inv.nvlink_domains:
        assert {inv.gpu(m).nvlink_domain for m in d.gpu_minors} == {d.id}  # type: ignore[union-attr]
    assert not inv.unavailable_gpus


def test_dgx_h100_is_eight_gpus_in_one_domain_with_the_documented_placements() -> None:
    inv = discover("dgx-h100")
    assert [f"gpu-{g.minor}" for g in inv.gpus] == [f"gpu-{i}" for i in range(8)]
    assert len(inv.nvlink_domains) == 1
    assert inv.nvlink_domains[0].gpu_minors == tuple(range(8))
    assert inv.cuda_driver_version == "12.4"
    for g in inv.gpus:
        assert (g.product_name, g.brand, g.architecture, g.cuda_compute_capability) == (
            "NVIDIA H100 80GB HBM3",
            "Nvidia",
            "Hopper",
            "9.0",
        )
        assert g.pci_device_id == 0x233010DE
        assert g.mig_capable and not g.mig_enabled and not g.mig_pending
        assert {p.name: len(p.placements) for p in g.mig_profiles} == H100_PLACEMENTS
        assert {p.name: p.gi_profile_id for p in g.mig_profiles} == H100_INFO_IDS
        assert sum(len(p.placements) for p in g.mig_profiles) == 25
    assert not inv.mig_devices


def test_h100_nvl_bridged_pairs_are_two_domains() -> None:
    inv = discover("h100-nvl-x4")
    assert sorted(d.gpu_minors for d in inv.nvlink_domains) == [(0, 1), (2, 3)]
    assert not any(d.fabric for d in inv.nvlink_domains)
    # Minor numbers are not indexes on this machine: index 0 is gpu-2.
    assert inv.gpus[0].minor == 2 and inv.gpu(2) is inv.gpus[0]


def test_gpus_without_nvlink_are_separate_domains() -> None:
    inv = discover("a100-pcie-x2")
    assert [d.gpu_minors for d in inv.nvlink_domains] == [(0,), (1,)]


def test_gh200_domain_is_the_fabric_clique() -> None:
    fabric = MACHINES["gh200"].fabric
    assert fabric is not None
    inv = discover("gh200")
    expected = f"{uuid.UUID(bytes=fabric.cluster_uuid)}.{fabric.clique_id}"
    assert [d.id for d in inv.nvlink_domains] == [expected]
    assert inv.nvlink_domains[0].fabric
    assert inv.gpus[0].nvlink_domain == expected
    assert inv.gpus[0].pci_bus_id.startswith("0009:")


def test_no_fabric_where_nvml_does_not_support_it() -> None:
    with open_nvml("fake:gh200") as source:
        source.fake.force_error("nvmlDeviceGetGpuFabricInfoV", pynvml.NVML_ERROR_NOT_SUPPORTED)
        inv = source.discover()
    assert inv.gpus[0].fabric is None
    assert not inv.nvlink_domains[0].fabric


@pytest.mark.parametrize(
    "change",
    [
        {"state": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS},  # tried: registration not finished
        {"status": pynvml.NVML_ERROR_UNKNOWN},  # tried: registration failed
        {"cluster_uuid": bytes(16)},  # tried: no cluster assigned
    ],
)
def test_a_gpu_not_attached_to_its_fabric_is_not_in_the_clique(change: dict[str, object]) -> None:
    base = MACHINES["gh200"]
    assert base.fabric is not None
    machine = dataclasses.replace(base, fabric=dataclasses.replace(base.fabric, **change))
    with fakes.nvml.install(machine), nvml_session():
        inv = discover_now()
    assert inv.gpus[0].fabric is None
    assert inv.nvlink_domains[0].id.startswith("node-")


def test_mixed_mig_reports_existing_mig_devices_on_mig_enabled_gpus() -> None:
    inv = discover("mixed-mig")
    assert [g.mig_enabled for g in inv.gpus] == [True, True, False, False]
    for g in inv.gpus[:2]:
        devices = inv.mig_devices_of(g.minor)
        assert Counter(m.profile for m in devices) == {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}
        assert all(m.uuid.startswith("MIG-") and m.parent_uuid == g.uuid for m in devices)
        assert len({m.uuid for m in devices}) == 4
        placed = [PlacedProfile.of(g.profile(m.gi_profile_id), m.placement) for m in devices]  # type: ignore[arg-type]
        assert is_valid_layout(placed, g.mig_profiles)
        assert {(gi.gpu_instance_id, gi.placement) for gi in g.gpu_instances} == {
            (m.gpu_instance_id, m.placement) for m in devices
        }
        for m in devices:
            profile = g.profile(m.gi_profile_id)
            assert profile is not None and profile.name == m.profile
            assert m.multiprocessors == profile.multiprocessors
            assert m.memory_bytes == profile.memory_bytes
            name = parse_device_name(
                f"gpu-{g.minor}-mig-{m.profile.replace('.', '')}-{m.gi_profile_id}-{m.placement.start}"
            )
            assert isinstance(name, MigName) and name.start == m.placement.start
    assert not inv.mig_devices_of(inv.gpus[2].minor)
    assert not inv.gpus[2].gpu_instances


def test_gpus_that_cannot_do_mig_have_no_profiles() -> None:
    inv = discover("l40s-x2")
    assert all(not g.mig_capable and not g.mig_profiles and not g.mig_enabled for g in inv.gpus)


def test_a_lost_gpu_is_skipped_and_reported() -> None:
    with open_nvml("fake:dgx-h100") as source:
        source.fake.lose_gpu(3)
        inv = source.discover()
    assert [g.index for g in inv.gpus] == [0, 1, 2, 4, 5, 6, 7]
    assert [u.index for u in inv.unavailable_gpus] == [3]
    assert "lost" in inv.unavailable_gpus[0].reason.lower()
    assert inv.nvlink_domains[0].gpu_minors == (0, 1, 2, 4, 5, 6, 7)


def test_a_gpu_lost_in_the_middle_of_mig_discovery_is_skipped() -> None:
    with open_nvml("fake:mixed-mig") as source:
        source.fake.force_error("nvmlDeviceGetMigDeviceHandleByIndex", pynvml.NVML_ERROR_GPU_IS_LOST)
        inv = source.discover()
    assert [u.index for u in inv.unavailable_gpus] == [0]
    assert {m.parent_index for m in inv.mig_devices} == {1}


def test_an_old_driver_without_v2_profile_info_still_names_profiles() -> None:
    expected = {g.uuid: [p.name for p in g.mig_profiles] for g in discover("dgx-a100-40gb").gpus}
    with open_nvml("fake:dgx-a100-40gb") as source:
        source.fake.remove_function("nvmlDeviceGetGpuInstanceProfileInfoV")
        inv = source.discover()
    assert {g.uuid: [p.name for p in g.mig_profiles] for g in inv.gpus} == expected
    assert "1g.5gb+me" in expected[inv.gpus[0].uuid]


@pytest.mark.parametrize(
    ("symbol", "check"),
    [
        ("nvmlDeviceGetNumaNodeId", lambda inv: all(g.numa_node is None for g in inv.gpus)),
        ("nvmlDeviceGetGpuFabricInfoV", lambda inv: inv.gpus[0].fabric is not None),  # the v1 call still answers
        ("nvmlDeviceGetArchitecture", lambda inv: inv.gpus[0].architecture == "Unknown"),
        ("nvmlSystemGetCudaDriverVersion_v2", lambda inv: inv.cuda_driver_version == "12.4"),
        ("nvmlDeviceGetMigMode", lambda inv: not inv.gpus[0].mig_capable),
    ],
)
def test_missing_functions_on_old_drivers_degrade_instead_of_failing(symbol: str, check: object) -> None:
    with open_nvml("fake:gh200") as source:
        source.fake.remove_function(symbol)
        inv = source.discover()
    assert len(inv.gpus) == 1
    assert check(inv)  # type: ignore[operator]


def test_mig_handle_errors_other_than_absent_take_that_gpu_out_not_the_node() -> None:
    """Tried: an unexpected NVML error on one GPU's MIG handles. The GPU is reported unavailable with the
    reason (never advertised half-known); the other GPUs are still served."""
    with open_nvml("fake:mixed-mig") as source:
        source.fake.force_error("nvmlDeviceGetMigDeviceHandleByIndex", pynvml.NVML_ERROR_UNKNOWN)
        inv = source.discover()
    assert [u.index for u in inv.unavailable_gpus] == [0]
    assert "MIG device 0 of GPU 0" in inv.unavailable_gpus[0].reason
    assert [g.index for g in inv.gpus] == [1, 2, 3]


def test_permission_errors_are_reported_as_project_errors() -> None:
    with open_nvml("fake:mixed-mig") as source:
        source.fake.force_error("nvmlDeviceGetGpuInstances", pynvml.NVML_ERROR_NO_PERMISSION)
        inv = source.discover()
    (unavailable,) = inv.unavailable_gpus
    assert unavailable.index == 0
    assert "permission" in unavailable.reason.lower()


def test_derived_profile_names_follow_nvidia_rounding() -> None:
    h100 = 81559 * 2**20
    assert derive_profile_name(1, 9984, h100) == "1g.10gb"
    assert derive_profile_name(3, 40448, h100) == "3g.40gb"
    assert derive_profile_name(1, 9984, h100, "+me") == "1g.10gb+me"
    assert derive_profile_name(7, 80896, h100) == "7g.80gb"


def test_nvml_spec_parsing() -> None:
    assert parse_nvml_spec("real").machine is None
    assert parse_nvml_spec("fake:dgx-h100").machine == "dgx-h100"
    for bad in ("", "fake:", "fake", "dgx-h100", "REAL"):  # tried: values that name no NVML
        with pytest.raises(InvalidNvmlSpec, match="real' or 'fake:<machine>"):
            parse_nvml_spec(bad)


def test_an_unknown_fake_machine_is_a_spec_error() -> None:
    # Tried: a machine the fake does not have.
    with pytest.raises(InvalidNvmlSpec, match="unknown fake NVML machine"), open_nvml("fake:dgx-z9000"):
        pass


def test_the_fake_is_removed_when_the_source_closes() -> None:
    previous = pynvml.nvmlLib
    with open_nvml("fake:dgx-h100") as source:
        assert fakes.nvml.installed() is source.fake
    assert fakes.nvml.installed() is None
    assert pynvml.nvmlLib is previous


def real_nvml_missing() -> bool:
    try:
        with open_nvml("real"):
            return False
    except NvmlUnavailable:
        return True


def test_real_nvml_without_the_library_is_unavailable() -> None:
    if not real_nvml_missing():
        pytest.skip("this machine has NVML")
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml.so.1"), open_nvml("real"):
        pass


def test_gpu_lost_is_a_distinct_project_error() -> None:
    with open_nvml("fake:dgx-h100") as source:
        source.fake.lose_gpu(0, xid=None)
        handle_error = None
        try:
            pynvml.nvmlDeviceGetHandleByIndex(0)
        except pynvml.NVMLError as exc:
            handle_error = translate(exc, "opening GPU 0")
    assert isinstance(handle_error, GpuLost)
    assert handle_error.code == pynvml.NVML_ERROR_GPU_IS_LOST
