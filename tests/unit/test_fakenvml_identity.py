"""The NVML fake seen through the real pynvml wrappers: machines, identity, topology, versions."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pynvml as N
import pytest

import fakes.nvml as fake_nvml


@pytest.fixture
def nvml(request: pytest.FixtureRequest) -> Iterator[fake_nvml.FakeNvml]:
    with fake_nvml.install(request.param) as fake:
        N.nvmlInit()
        yield fake
        N.nvmlShutdown()


def handles() -> list[object]:
    return [N.nvmlDeviceGetHandleByIndex(i) for i in range(N.nvmlDeviceGetCount())]


def test_unknown_machine_is_refused_with_the_known_names() -> None:
    # Trying a machine name that does not exist.
    with pytest.raises(ValueError, match="dgx-h100") as err:
        fake_nvml.install("dgx-z900")
    assert "dgx-z900" in str(err.value)


def test_contract_machine_names_exist() -> None:
    for name in [
        "dgx-a100-40gb",
        "dgx-a100-80gb",
        "dgx-h100",
        "hgx-h200",
        "h100-nvl-x4",
        "gh200",
        "a100-pcie-x2",
        "mixed-mig",
    ]:
        assert name in fake_nvml.machine_names()
        assert name in fake_nvml.MACHINES


@pytest.mark.parametrize("machine", fake_nvml.machine_names())
def test_every_machine_reports_realistic_identity(machine: str) -> None:
    with fake_nvml.install(machine) as fake:
        N.nvmlInit()
        hs = handles()
        assert len(hs) == len(fake.machine.gpus) > 0
        uuids = [N.nvmlDeviceGetUUID(h) for h in hs]
        uuid4 = r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
        assert all(re.fullmatch(uuid4, u) for u in uuids)
        assert len(set(uuids)) == len(uuids)
        for i, h in enumerate(hs):
            assert N.nvmlDeviceGetIndex(h) == i
            pci = N.nvmlDeviceGetPciInfo(h)
            assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:00\.0", pci.busId)
            assert pci.pciDeviceId & 0xFFFF == 0x10DE
            assert N.nvmlDeviceGetName(h).startswith("NVIDIA ")
            assert N.nvmlDeviceGetBrand(h) == N.NVML_BRAND_NVIDIA
            mem = N.nvmlDeviceGetMemoryInfo(h)
            assert mem.total >= 40 << 30 and mem.free == mem.total - mem.used
            # handles found by uuid and by bus id are the same device
            assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(uuids[i])) == i
            assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(pci.busId)) == i
        assert N.nvmlSystemGetDriverVersion() == "550.54.15"
        assert N.nvmlSystemGetCudaDriverVersion() == 12040
        N.nvmlShutdown()


def test_uuids_are_stable_across_installs_and_differ_between_machines() -> None:
    def uuids(machine: str) -> list[str]:
        with fake_nvml.install(machine):
            N.nvmlInit()
            return [N.nvmlDeviceGetUUID(h) for h in handles()]

    assert uuids("dgx-h100") == uuids("dgx-h100")
    assert set(uuids("dgx-h100")).isdisjoint(uuids("hgx-h200"))


def test_calls_before_init_fail_and_uninstall_restores_pynvml() -> None:
    before = N.nvmlLib
    with fake_nvml.install("dgx-h100"):
        # Trying a call without nvmlInit, as the real library would refuse it.
        with pytest.raises(N.NVMLError_Uninitialized):
            N.nvmlDeviceGetCount()
        N.nvmlInit()
        assert N.nvmlDeviceGetCount() == 8
        N.nvmlShutdown()
        with pytest.raises(N.NVMLError_Uninitialized):
            N.nvmlDeviceGetCount()
    assert N.nvmlLib is before
    assert fake_nvml.installed() is None


@pytest.mark.parametrize("nvml", ["dgx-h100"], indirect=True)
def test_h100_identity(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert N.nvmlDeviceGetArchitecture(h) == N.NVML_DEVICE_ARCH_HOPPER
    assert N.nvmlDeviceGetCudaComputeCapability(h) == (9, 0)
    assert N.nvmlDeviceGetPciInfo(h).pciDeviceId == 0x233010DE
    assert N.nvmlDeviceGetPciInfo(h).busId == "00000000:18:00.0"
    # bus ids are accepted in the short forms NVML takes too
    assert N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId("0000:2a:00.0")) == 1
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetHandleByUUID("GPU-00000000-0000-4000-8000-000000000000")
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetHandleByIndex(8)


@pytest.mark.parametrize("nvml", ["h100-nvl-x4"], indirect=True)
def test_nvl_minor_numbers_differ_from_indexes(nvml: fake_nvml.FakeNvml) -> None:
    minors = [N.nvmlDeviceGetMinorNumber(h) for h in handles()]
    assert sorted(minors) == [0, 1, 2, 3]
    assert any(m != i for i, m in enumerate(minors))


def nvlink_peers(h: object) -> list[str]:
    peers, link = [], 0
    while True:
        try:
            active = N.nvmlDeviceGetNvLinkState(h, link)
        except N.NVMLError_NotSupported:
            return peers
        if active:
            peers.append(N.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
        link += 1


@pytest.mark.parametrize("nvml", ["h100-nvl-x4"], indirect=True)
def test_nvl_bridges_link_pairs(nvml: fake_nvml.FakeNvml) -> None:
    hs = handles()
    bus = [N.nvmlDeviceGetPciInfo(h).busId for h in hs]
    assert set(nvlink_peers(hs[0])) == {bus[1]}
    assert set(nvlink_peers(hs[1])) == {bus[0]}
    assert set(nvlink_peers(hs[2])) == {bus[3]}
    assert N.nvmlDeviceGetNvLinkRemoteDeviceType(hs[0], 0) == N.NVML_NVLINK_DEVICE_TYPE_GPU
    assert N.nvmlDeviceGetNvLinkCapability(hs[0], 0, N.NVML_NVLINK_CAP_P2P_SUPPORTED) == 1


@pytest.mark.parametrize("nvml", ["dgx-h100"], indirect=True)
def test_nvswitch_links_lead_to_shared_switches(nvml: fake_nvml.FakeNvml) -> None:
    hs = handles()
    gpu_buses = {N.nvmlDeviceGetPciInfo(h).busId for h in hs}
    switch_sets = [set(nvlink_peers(h)) for h in hs]
    assert all(len(nvlink_peers(h)) == 18 for h in hs[:1])
    assert all(s == switch_sets[0] for s in switch_sets) and switch_sets[0].isdisjoint(gpu_buses)
    assert N.nvmlDeviceGetNvLinkRemoteDeviceType(hs[0], 0) == N.NVML_NVLINK_DEVICE_TYPE_SWITCH
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetNvLinkState(hs[0], 18)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetGpuFabricInfoV(hs[0], N.byref(N.c_nvmlGpuFabricInfoV_t()))


@pytest.mark.parametrize("nvml", ["a100-pcie-x2"], indirect=True)
def test_pcie_a100_has_no_nvlink_and_sits_on_two_sockets(nvml: fake_nvml.FakeNvml) -> None:
    a, b = handles()
    assert nvlink_peers(a) == []
    assert N.nvmlDeviceGetTopologyCommonAncestor(a, b) == N.NVML_TOPOLOGY_SYSTEM
    assert N.nvmlDeviceGetTopologyCommonAncestor(a, a) == N.NVML_TOPOLOGY_INTERNAL


@pytest.mark.parametrize("nvml", ["gh200"], indirect=True)
def test_gh200_reports_a_completed_fabric_clique(nvml: fake_nvml.FakeNvml) -> None:
    (h,) = handles()
    info = N.c_nvmlGpuFabricInfoV_t()
    N.nvmlDeviceGetGpuFabricInfoV(h, N.byref(info))
    assert info.state == N.NVML_GPU_FABRIC_STATE_COMPLETED and info.status == 0
    assert any(bytes(info.clusterUuid)) and info.cliqueId == 32766
    assert N.nvmlDeviceGetPciInfo(h).domain == 9
    # a struct with a wrong version is refused, as the real library does
    stale = N.c_nvmlGpuFabricInfoV_t()
    stale.version = 1
    with pytest.raises(N.NVMLError_ArgumentVersionMismatch):
        N.nvmlDeviceGetGpuFabricInfoV(h, N.byref(stale))


@pytest.mark.parametrize("nvml", ["dgx-a100-40gb"], indirect=True)
def test_compute_mode_round_trip(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(3)
    assert N.nvmlDeviceGetComputeMode(h) == N.NVML_COMPUTEMODE_DEFAULT
    N.nvmlDeviceSetComputeMode(h, N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert N.nvmlDeviceGetComputeMode(h) == N.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert N.nvmlDeviceGetComputeMode(N.nvmlDeviceGetHandleByIndex(2)) == N.NVML_COMPUTEMODE_DEFAULT
    # Trying a compute mode that does not exist.
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceSetComputeMode(h, 7)


@pytest.mark.parametrize("nvml", ["l40s-x2"], indirect=True)
def test_mig_queries_are_not_supported_on_non_mig_gpus(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetMigMode(h)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetMaxMigDeviceCount(h)
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceSetMigMode(h, N.NVML_DEVICE_MIG_ENABLE)
