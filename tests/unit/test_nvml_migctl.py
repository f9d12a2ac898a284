"""MigControl against the NVML fake: creating one MIG device at a placement, and destroying it again."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml
import pytest

from agent.devices.model import MigPlacement
from agent.nvml.errors import InsufficientResources, InUse, InvalidArgument, NotSupported
from agent.nvml.migctl import MigControl, MigCreateFailed
from agent.nvml.source import NvmlSource, open_nvml

ONE_G, TWO_G, THREE_G, SEVEN_G = 19, 14, 9, 0  # info.id of H100 80GB profiles


@pytest.fixture
def nvml(request: pytest.FixtureRequest) -> Iterator[NvmlSource]:
    with open_nvml(f"fake:{getattr(request, 'param', 'dgx-h100')}") as source:
        yield source


def mig_on(index: int) -> None:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    assert pynvml.nvmlDeviceSetMigMode(h, pynvml.NVML_DEVICE_MIG_ENABLE) == 0  # Hopper: at once when idle


def test_create_makes_a_mig_device_that_discovery_sees(nvml: NvmlSource) -> None:
    mig_on(1)
    gpu = nvml.fake.gpus[1]
    made = MigControl().create(gpu.uuid, ONE_G, 3)
    assert made.uuid.startswith("MIG-")
    [mig] = nvml.discover().mig_devices_of(gpu.minor)
    assert (mig.uuid, mig.profile, mig.placement) == (made.uuid, "1g.10gb", MigPlacement(3, 1))
    assert (mig.gpu_instance_id, mig.compute_instance_id) == (made.gpu_instance_id, made.compute_instance_id)


def test_compute_instance_spans_the_whole_gpu_instance(nvml: NvmlSource) -> None:
    mig_on(0)
    made = MigControl().create(0, SEVEN_G, 0)  # by minor
    [mig] = nvml.discover().mig_devices_of(0)
    assert (mig.uuid, mig.profile, mig.multiprocessors) == (made.uuid, "7g.80gb", 132)


@pytest.mark.parametrize("nvml", ["h100-nvl-x4"], indirect=True)
def test_a_gpu_named_by_minor_is_found_when_minors_differ_from_indexes(nvml: NvmlSource) -> None:
    index = next(i for i, g in enumerate(nvml.fake.gpus) if g.minor != i)
    mig_on(index)
    MigControl().create(nvml.fake.gpus[index].minor, TWO_G, 2)
    assert [gi.start for gi in nvml.fake.gpus[index].gpu_instances.values()] == [2]


def test_an_overlapping_placement_is_refused_as_taken_and_nothing_is_added(nvml: NvmlSource) -> None:
    mig_on(1)
    gpu = nvml.fake.gpus[1]
    MigControl().create(gpu.uuid, THREE_G, 4)  # memory slices 4..7
    with pytest.raises(InsufficientResources, match="placement taken"):
        MigControl().create(gpu.uuid, ONE_G, 5)  # tries slice 5, inside the 3g
    assert [gi.start for gi in gpu.gpu_instances.values()] == [4]


def test_a_start_that_is_no_placement_of_the_profile_is_an_invalid_argument(nvml: NvmlSource) -> None:
    mig_on(1)
    with pytest.raises(InvalidArgument, match="1 is not a placement"):
        MigControl().create(nvml.fake.gpus[1].uuid, TWO_G, 1)  # 2g starts at 0, 2 or 4


def test_creating_on_a_gpu_with_mig_off_is_not_supported(nvml: NvmlSource) -> None:
    with pytest.raises(NotSupported):
        MigControl().create(nvml.fake.gpus[2].uuid, ONE_G, 0)
    assert not nvml.fake.gpus[2].gpu_instances


def test_a_failure_after_the_gpu_instance_exists_destroys_it(nvml: NvmlSource) -> None:
    mig_on(1)
    nvml.fake.force_error("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(Exception, match="creating the compute instance"):
        MigControl().create(nvml.fake.gpus[1].uuid, ONE_G, 0)
    assert not nvml.fake.gpus[1].gpu_instances


def test_a_failed_cleanup_says_that_something_is_left_behind(nvml: NvmlSource) -> None:
    mig_on(1)
    nvml.fake.force_error("nvmlGpuInstanceCreateComputeInstance", pynvml.NVML_ERROR_UNKNOWN)
    nvml.fake.force_error("nvmlGpuInstanceDestroy", pynvml.NVML_ERROR_GPU_IS_LOST)
    with pytest.raises(MigCreateFailed, match="cleaning up failed too") as raised:
        MigControl().create(nvml.fake.gpus[1].uuid, ONE_G, 0)
    assert raised.value.left_behind
    assert list(nvml.fake.gpus[1].gpu_instances) == [7]  # the GI that could not be destroyed


def test_destroy_removes_the_device_and_a_second_destroy_is_a_no_op(nvml: NvmlSource) -> None:
    mig_on(1)
    gpu = nvml.fake.gpus[1]
    migs = MigControl()
    made = migs.create(gpu.uuid, ONE_G, 3)
    kept = migs.create(gpu.uuid, ONE_G, 4)
    migs.destroy(gpu.uuid, made.gpu_instance_id, made.compute_instance_id)
    assert [m.uuid for m in nvml.discover().mig_devices_of(gpu.minor)] == [kept.uuid]
    migs.destroy(gpu.uuid, made.gpu_instance_id, made.compute_instance_id)  # already gone: destroyed
    assert [m.uuid for m in nvml.discover().mig_devices_of(gpu.minor)] == [kept.uuid]


def test_destroying_a_device_in_use_is_an_error_and_leaves_it(nvml: NvmlSource) -> None:
    mig_on(1)
    gpu = nvml.fake.gpus[1]
    made = MigControl().create(gpu.uuid, ONE_G, 3)
    nvml.fake.set_processes(1, [(4242, 2**30)], made.gpu_instance_id, made.compute_instance_id)
    with pytest.raises(InUse):
        MigControl().destroy(gpu.uuid, made.gpu_instance_id, made.compute_instance_id)
    assert [m.uuid for m in nvml.discover().mig_devices_of(gpu.minor)] == [made.uuid]


def test_destroy_at_finds_the_instance_by_its_placement(nvml: NvmlSource) -> None:
    mig_on(1)
    gpu = nvml.fake.gpus[1]
    migs = MigControl()
    made = migs.create(gpu.uuid, TWO_G, 2)
    assert migs.find(gpu.uuid, TWO_G, 2) == (made.gpu_instance_id, (made.compute_instance_id,))
    assert migs.find(gpu.uuid, TWO_G, 4) is None
    assert not migs.destroy_at(gpu.uuid, TWO_G, 4)
    assert migs.destroy_at(gpu.uuid, TWO_G, 2)
    assert not gpu.gpu_instances
