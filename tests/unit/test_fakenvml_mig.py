"""MIG rules of the NVML fake, driven only through the real pynvml wrappers."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml as N
import pytest

import fakes.nvml as fake_nvml

ONE_G, ONE_G_ME, TWO_G, THREE_G, SEVEN_G = 19, 20, 14, 9, 0  # info.id on H100/A100


@pytest.fixture
def nvml(request: pytest.FixtureRequest) -> Iterator[fake_nvml.FakeNvml]:
    with fake_nvml.install(getattr(request, "param", "dgx-h100")) as fake:
        N.nvmlInit()
        yield fake
        N.nvmlShutdown()


def mig_on(index: int = 0) -> object:
    h = N.nvmlDeviceGetHandleByIndex(index)
    assert N.nvmlDeviceSetMigMode(h, N.NVML_DEVICE_MIG_ENABLE) == N.NVML_SUCCESS
    return h


def placements(h: object, profile_id: int) -> list[tuple[int, int]]:
    count = N.c_uint()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, N.byref(count))
    array = (N.c_nvmlGpuInstancePlacement_t * count.value)()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, array, N.byref(count))
    return [(p.start, p.size) for p in array[: count.value]]


def gi_info(gi: object) -> tuple[int, int, int]:
    info = N.nvmlGpuInstanceGetInfo(gi)
    return info.id, info.placement.start, info.placement.size


def test_h100_profiles_and_their_25_placements(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(0)  # MIG off: profiles and placements still answer
    found = {}
    for enum in range(N.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = N.nvmlDeviceGetGpuInstanceProfileInfo(h, enum)
        except N.NVMLError_NotSupported:
            continue
        found[info.name] = (enum, info.id, len(placements(h, info.id)))
    assert found == {
        "MIG 1g.10gb": (0, 19, 7),
        "MIG 1g.10gb+me": (7, 20, 7),
        "MIG 1g.20gb": (9, 15, 4),
        "MIG 2g.20gb": (1, 14, 3),
        "MIG 3g.40gb": (2, 9, 2),
        "MIG 4g.40gb": (3, 5, 1),
        "MIG 7g.80gb": (4, 0, 1),
    }
    assert placements(h, THREE_G) == [(0, 4), (4, 4)]
    seven = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    assert (seven.multiprocessorCount, seven.memorySizeMB, seven.sliceCount) == (132, 81152, 7)
    with pytest.raises(N.NVMLError_InvalidArgument):  # past NVML_GPU_INSTANCE_PROFILE_COUNT
        N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_COUNT)


def test_profile_enum_is_not_the_profile_id(nvml: fake_nvml.FakeNvml) -> None:
    h = mig_on()
    rev2 = N.nvmlDeviceGetGpuInstanceProfileInfo(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2)
    assert (rev2.id, rev2.name) == (15, "MIG 1g.20gb")
    # Trying the enum where an id is expected: enum 9 names the 3g profile (id 9), not 1g.20gb.
    assert placements(h, N.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2) == [(0, 4), (4, 4)]
    # enum 4 (7_SLICE) is no profile id at all
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceCreateGpuInstance(h, N.NVML_GPU_INSTANCE_PROFILE_7_SLICE)
    by_id = N.nvmlDeviceGetGpuInstanceProfileInfoById(h, 15)
    assert by_id.name == "MIG 1g.20gb"


def test_placement_tables_of_other_products_come_from_the_shared_table(shared_dir: object) -> None:
    with fake_nvml.install("hgx-h200"):
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        names = [N.nvmlDeviceGetGpuInstanceProfileInfo(h, e).name for e in (0, 7, 9, 1, 2, 3, 4)]
        assert names == [
            "MIG 1g.18gb",
            "MIG 1g.18gb+me",
            "MIG 1g.35gb",
            "MIG 2g.35gb",
            "MIG 3g.71gb",
            "MIG 4g.71gb",
            "MIG 7g.141gb",
        ]
        # memory was not measured for H200: derived values must still round to the profile names
        total = N.nvmlDeviceGetMemoryInfo(h).total
        for e, slices in ((0, 1), (9, 2), (2, 4), (4, 8)):
            mem = N.nvmlDeviceGetGpuInstanceProfileInfo(h, e).memorySizeMB << 20
            assert -(-mem * 8 // total) == slices
        N.nvmlShutdown()


def test_creating_needs_mig_mode(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(0)
    assert N.nvmlDeviceGetMigMode(h) == [0, 0]
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceCreateGpuInstance(h, ONE_G)
    assert N.nvmlDeviceGetMaxMigDeviceCount(h) == 0


def test_hopper_enables_mig_at_once_when_idle(nvml: fake_nvml.FakeNvml) -> None:
    h = mig_on(0)
    assert N.nvmlDeviceGetMigMode(h) == [1, 1]
    assert N.nvmlDeviceGetMaxMigDeviceCount(h) == 7
    nvml.set_processes(1, [(4242, 1 << 30)])
    busy = N.nvmlDeviceGetHandleByIndex(1)
    assert N.nvmlDeviceSetMigMode(busy, N.NVML_DEVICE_MIG_ENABLE) == N.NVML_ERROR_IN_USE
    assert N.nvmlDeviceGetMigMode(busy) == [0, 1]


@pytest.mark.parametrize("nvml", ["dgx-a100-40gb"], indirect=True)
def test_ampere_mode_stays_pending_until_reset(nvml: fake_nvml.FakeNvml) -> None:
    h = N.nvmlDeviceGetHandleByIndex(2)
    status = N.nvmlDeviceSetMigMode(h, N.NVML_DEVICE_MIG_ENABLE)
    assert status == N.NVML_ERROR_RESET_REQUIRED
    assert N.nvmlDeviceGetMigMode(h) == [0, 1]
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceCreateGpuInstance(h, ONE_G)
    nvml.reset_gpu(2)
    assert N.nvmlDeviceGetMigMode(h) == [1, 1]
    gi = N.nvmlDeviceCreateGpuInstance(h, ONE_G)
    assert N.nvmlDeviceGetGpuInstanceProfileInfo(h, 0).name == "MIG 1g.5gb"
    assert gi_info(gi)[1] == 6
    # disabling with instances present is refused; after destroying it is pending again until reset
    with pytest.raises(N.NVMLError_InUse):
        N.nvmlDeviceSetMigMode(h, N.NVML_DEVICE_MIG_DISABLE)
    N.nvmlGpuInstanceDestroy(gi)
    N.nvmlDeviceSetMigMode(h, N.NVML_DEVICE_MIG_DISABLE)
    assert N.nvmlDeviceGetMigMode(h) == [1, 0]
    nvml.set_processes(2, [(7, 1 << 20)])
    with pytest.raises(fake_nvml.GpuBusy):
        nvml.reset_gpu(2)


def test_auto_placement_follows_the_drivers_order(nvml: fake_nvml.FakeNvml) -> None:
    h = mig_on()
    created = [gi_info(N.nvmlDeviceCreateGpuInstance(h, ONE_G)) for _ in range(7)]
    assert [start for _, start, _ in created] == [6, 4, 5, 0, 1, 2, 3]
    assert [gi_id for gi_id, _, _ in created] == [13, 11, 12, 7, 8, 9, 10]
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlDeviceCreateGpuInstance(h, ONE_G)
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, ONE_G) == 0


def test_order_of_creation_matters_like_the_guide_says(nvml: fake_nvml.FakeNvml) -> None:
    first, second = mig_on(0), mig_on(1)
    for pid in (ONE_G, ONE_G, TWO_G):
        N.nvmlDeviceCreateGpuInstance(first, pid)
    # Trying `nvidia-smi mig -cgi 19,19,14,9`: the 3g no longer fits.
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlDeviceCreateGpuInstance(first, THREE_G)
    # `-cgi 9,19,14,19` works
    made = [gi_info(N.nvmlDeviceCreateGpuInstance(second, pid)) for pid in (THREE_G, ONE_G, TWO_G, ONE_G)]
    assert made == [(2, 4, 4), (7, 0, 1), (4, 2, 2), (8, 1, 1)]


def test_explicit_placements_are_checked(nvml: fake_nvml.FakeNvml) -> None:
    h = mig_on()
    gi = N.nvmlDeviceCreateGpuInstanceWithPlacement(h, TWO_G, N.byref(N.c_nvmlGpuInstancePlacement_t(2, 2)))
    assert gi_info(gi) == (4, 2, 2)
    # Trying a 1g on a slice the 2g already holds.
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(h, ONE_G, N.byref(N.c_nvmlGpuInstancePlacement_t(3, 1)))
    # Trying a start the profile has no placement for.
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceCreateGpuInstanceWithPlacement(h, TWO_G, N.byref(N.c_nvmlGpuInstancePlacement_t(1, 2)))
    N.nvmlDeviceCreateGpuInstance(h, ONE_G_ME)
    # Trying a second +me instance: one per GPU.
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlDeviceCreateGpuInstance(h, ONE_G_ME)
    # 2g holds 2-3 and the +me took 6: 1g fits at 0, 1, 4, 5; no 3g half is free
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, ONE_G) == 4
    assert N.nvmlDeviceGetGpuInstanceRemainingCapacity(h, THREE_G) == 0


def test_instances_list_and_destroy_rules(nvml: fake_nvml.FakeNvml) -> None:
    h = mig_on()
    gi = N.nvmlDeviceCreateGpuInstance(h, THREE_G)
    gi_id = gi_info(gi)[0]
    listed = (N.c_nvmlGpuInstance_t * 2)()
    count = N.c_uint()
    N.nvmlDeviceGetGpuInstances(h, THREE_G, listed, N.byref(count))
    assert count.value == 1 and gi_info(listed[0])[0] == gi_id
    assert gi_info(N.nvmlDeviceGetGpuInstanceById(h, gi_id))[0] == gi_id
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetGpuInstanceById(h, 13)

    full = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0)
    assert (full.name, full.multiprocessorCount) == ("MIG 3g.40gb", 60)
    part = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
    assert part.name == "MIG 1c.3g.40gb" and part.instanceCount == 3
    with pytest.raises(N.NVMLError_NotSupported):  # a 7-slice CI does not fit a 3g GI
        N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE, 0)
    ci = N.nvmlGpuInstanceCreateComputeInstance(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    with pytest.raises(N.NVMLError_InsufficientResources):
        N.nvmlGpuInstanceCreateComputeInstance(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
    ci_info = N.nvmlComputeInstanceGetInfo(ci)
    assert (ci_info.id, ci_info.profileId) == (0, N.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    mig_uuid = N.nvmlDeviceGetUUID(ci_info.device)
    assert mig_uuid.startswith("MIG-")

    # Trying to destroy a GI that still has a CI.
    with pytest.raises(N.NVMLError_InUse) as err:
        N.nvmlGpuInstanceDestroy(gi)
    assert "In use by another client" in str(err.value)
    nvml.set_processes(0, [(99, 1 << 30)], gpu_instance_id=gi_id, compute_instance_id=0)
    assert [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(ci_info.device)] == [99]
    # Trying to destroy a CI a process still runs on.
    with pytest.raises(N.NVMLError_InUse):
        N.nvmlComputeInstanceDestroy(ci)
    nvml.set_processes(0, [], gpu_instance_id=gi_id, compute_instance_id=0)
    N.nvmlComputeInstanceDestroy(ci)
    N.nvmlGpuInstanceDestroy(gi)
    assert nvml.gpus[0].gpu_instances == {}
    with pytest.raises(N.NVMLError_NotFound):
        N.nvmlDeviceGetHandleByUUID(mig_uuid)


@pytest.mark.parametrize("nvml", ["mixed-mig"], indirect=True)
def test_mixed_mig_starts_with_all_balanced_and_sparse_mig_handles(nvml: fake_nvml.FakeNvml) -> None:
    parent = N.nvmlDeviceGetHandleByIndex(0)
    parent_uuid = N.nvmlDeviceGetUUID(parent)
    assert N.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert N.nvmlDeviceGetMigMode(N.nvmlDeviceGetHandleByIndex(2)) == [0, 0]
    assert N.nvmlDeviceGetMaxMigDeviceCount(N.nvmlDeviceGetHandleByIndex(2)) == 0

    found, missing = {}, []
    for i in range(N.nvmlDeviceGetMaxMigDeviceCount(parent)):
        try:
            mig = N.nvmlDeviceGetMigDeviceHandleByIndex(parent, i)
        except N.NVMLError_NotFound:
            missing.append(i)
            continue
        assert N.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        assert N.nvmlDeviceGetUUID(N.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == parent_uuid
        uuid = N.nvmlDeviceGetUUID(mig)
        assert uuid.startswith("MIG-") and N.nvmlDeviceGetUUID(N.nvmlDeviceGetHandleByUUID(uuid)) == uuid
        attrs = N.nvmlDeviceGetAttributes(mig)
        found[i] = (
            N.nvmlDeviceGetName(mig),
            N.nvmlDeviceGetGpuInstanceId(mig),
            N.nvmlDeviceGetComputeInstanceId(mig),
            attrs.gpuInstanceSliceCount,
            attrs.memorySizeMB,
        )
    assert missing, "indexes must be sparse"
    assert sorted(n for n, *_ in found.values()) == sorted(
        f"NVIDIA H100 80GB HBM3 MIG {p}" for p in ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")
    )
    ids = {(gi, ci, slices) for _, gi, ci, slices, _ in found.values()}
    assert ids == {(2, 0, 3), (3, 0, 2), (9, 0, 1), (10, 0, 1)}
    assert N.nvmlDeviceIsMigDeviceHandle(parent).value == 0
    with pytest.raises(N.NVMLError_NotSupported):
        N.nvmlDeviceGetGpuInstanceId(parent)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlDeviceGetMigDeviceHandleByIndex(parent, 7)
    # the fake's own state agrees
    assert sorted(gi.profile.name for gi in nvml.gpus[1].gpu_instances.values()) == [
        "1g.10gb",
        "1g.10gb",
        "2g.20gb",
        "3g.40gb",
    ]


def test_a_reset_voids_compute_instance_handles_taken_before_it(nvml: fake_nvml.FakeNvml) -> None:
    """Tried: using a compute-instance handle after `nvidia-smi -r` dropped every instance of its GPU."""
    h = mig_on(0)
    gi = N.nvmlDeviceCreateGpuInstance(h, ONE_G)
    info = N.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, N.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
    ci = N.nvmlGpuInstanceCreateComputeInstance(gi, info.id)
    N.nvmlComputeInstanceGetInfo(ci)  # valid before the reset
    nvml.reset_gpu(0)
    with pytest.raises(N.NVMLError_InvalidArgument):
        N.nvmlComputeInstanceGetInfo(ci)
