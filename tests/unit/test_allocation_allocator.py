"""Local allocator: fit, selectors, matchAttribute, NVLink preference, MIG placement choice, exclusions, sharing."""

from __future__ import annotations

import pytest

from agent.allocation.allocator import Allocator, Claim, DeviceRequest, NoFit, Policy
from agent.allocation.capacity import summarize
from agent.allocation.catalog import NodeUsage
from agent.allocation.selectors import CelSelectors, SelectorError
from agent.devices.geometry import PlacedProfile, count_free_placements
from agent.devices.model import Gpu, GpuInstance, Inventory, MigDevice, MigPlacement, MigProfile
from agent.names import MIG_CLASS

GiB = 1 << 30


def mig_profiles() -> tuple[MigProfile, ...]:
    def p(name: str, gi: int, compute: int, mem: int, count: int, starts: list[int]) -> MigProfile:
        return MigProfile(
            name,
            gi,
            gi,
            compute,
            mem,
            count,
            mem * 5 * 1024,
            compute * 14,
            1,
            0,
            0,
            0,
            0,
            tuple(MigPlacement(s, mem) for s in starts),
        )

    return (
        p("1g.5gb", 19, 1, 1, 7, list(range(7))),
        p("2g.10gb", 14, 2, 2, 3, [0, 2, 4]),
        p("3g.20gb", 9, 3, 4, 2, [0, 4]),
        p("7g.40gb", 0, 7, 8, 1, [0]),
    )


def gpu(
    minor: int,
    domain: str,
    product: str = "NVIDIA H100 80GB HBM3",
    mem: int = 80,
    mig: bool = False,
    shareable: bool = True,
) -> Gpu:
    return Gpu(
        minor,
        minor,
        f"GPU-{minor:04d}",
        product,
        "Nvidia",
        "Hopper",
        "9.0",
        mem * GiB,
        f"0000:{minor:02x}:00.0",
        0x233010DE,
        mig_capable=mig,
        mig_enabled=mig,
        mig_profiles=mig_profiles() if mig else (),
        nvlink_domain=domain,
        time_slicing_supported=shareable,
        mps_supported=shareable,
    )


def inventory(*gpus: Gpu, mig_devices: tuple[MigDevice, ...] = ()) -> Inventory:
    return Inventory("550.54.15", "12.4", gpus=gpus, mig_devices=mig_devices)


# 8 GPUs: domain A holds 0-3, domain B holds 4-7
EIGHT = inventory(*(gpu(i, "A" if i < 4 else "B") for i in range(8)))
ALLOC = Allocator(CelSelectors())


def one(name: str = "r", **kw: object) -> Claim:
    return Claim((DeviceRequest(name, **kw),))  # type: ignore[arg-type]


def test_whole_gpus_fit_and_a_too_large_request_does_not() -> None:
    fit = ALLOC.allocate(EIGHT, NodeUsage(), one(count=2))
    assert len(fit.devices["r"]) == 2
    with pytest.raises(NoFit):  # tried: nine GPUs on an eight-GPU node
        ALLOC.allocate(EIGHT, NodeUsage(), one(count=9))


def test_taken_devices_of_every_kind_are_excluded() -> None:
    usage = NodeUsage(
        allocated=frozenset({"gpu-0"}),
        prepared=frozenset({"gpu-1"}),
        reserved=frozenset({"gpu-2"}),
        unhealthy=frozenset({"gpu-3"}),
    )
    fit = ALLOC.allocate(EIGHT, usage, one(count=4))
    assert set(fit.devices["r"]) == {"gpu-4", "gpu-5", "gpu-6", "gpu-7"}
    with pytest.raises(NoFit):  # tried: five GPUs where only four are left
        ALLOC.allocate(EIGHT, usage, one(count=5))


def test_gang_of_gpus_prefers_one_nvlink_domain() -> None:
    usage = NodeUsage(allocated=frozenset({"gpu-0"}))  # A has 3 free, B has 4
    fit = ALLOC.allocate(EIGHT, usage, one(count=3))
    assert set(fit.devices["r"]) == {"gpu-1", "gpu-2", "gpu-3"}  # binpack: the tighter domain that holds them
    fit = ALLOC.allocate(EIGHT, usage, one(count=4))
    assert set(fit.devices["r"]) == {"gpu-4", "gpu-5", "gpu-6", "gpu-7"}
    spread = Allocator(CelSelectors(), Policy.SPREAD).allocate(EIGHT, usage, one(count=2))
    assert {d for d in spread.devices["r"]} <= {"gpu-4", "gpu-5", "gpu-6", "gpu-7"}


def test_match_attribute_keeps_all_devices_in_one_domain_or_fails() -> None:
    usage = NodeUsage(allocated=frozenset({"gpu-0", "gpu-4"}))  # 3 + 3 free
    claim = Claim(
        (DeviceRequest("a", count=2), DeviceRequest("b", count=1)), match_attributes=("gpu.nvidia.com/nvlinkDomain",)
    )
    fit = ALLOC.allocate(EIGHT, usage, claim)
    domains = {"A" if int(d.split("-")[1]) < 4 else "B" for d in fit.all_devices}
    assert len(domains) == 1 and len(fit.all_devices) == 3
    with pytest.raises(NoFit, match="nvlinkDomain"):  # tried: four GPUs in one domain when each has three
        ALLOC.allocate(EIGHT, usage, Claim((DeviceRequest("a", count=4),), ("gpu.nvidia.com/nvlinkDomain",)))


def test_cel_selectors_on_attributes_and_memory_quantity() -> None:
    inv = inventory(gpu(0, "A", "NVIDIA A100-SXM4-40GB", 40), gpu(1, "B", "NVIDIA H100 80GB HBM3", 80))
    by_name = ALLOC.allocate(
        inv, NodeUsage(), one(selectors=("device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H100 80GB HBM3'",))
    )
    assert by_name.devices["r"] == ("gpu-1",)
    by_mem = ALLOC.allocate(
        inv, NodeUsage(), one(selectors=("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('60Gi')) >= 0",))
    )
    assert by_mem.devices["r"] == ("gpu-1",)
    small = ALLOC.allocate(
        inv,
        NodeUsage(),
        one(
            selectors=(
                "device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('41Gi'))",
                "device.driver == 'gpu.nvidia.com'",
            )
        ),
    )
    assert small.devices["r"] == ("gpu-0",)
    with pytest.raises(NoFit):  # tried: an attribute no device has
        ALLOC.allocate(inv, NodeUsage(), one(selectors=("device.attributes['gpu.nvidia.com'].nosuch == 'x'",)))
    with pytest.raises(SelectorError, match="does not compile"):  # tried: a syntax error
        ALLOC.allocate(inv, NodeUsage(), one(selectors=("device.driver ==",)))


def test_bad_requests_are_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="device class"):
        DeviceRequest("r", device_class="tpu.example.com")
    with pytest.raises(ValueError, match="count"):
        DeviceRequest("r", count=0)
    with pytest.raises(ValueError, match="fraction"):
        DeviceRequest("r", gpu_milli=1000)


def test_fractions_share_a_gpu_tightest_first_and_never_a_whole_gpu_in_use() -> None:
    usage = NodeUsage(shared_milli={"gpu-2": 600})
    fit = ALLOC.allocate(EIGHT, usage, one(gpu_milli=300))
    assert fit.devices["r"] == ("gpu-2",) and fit.shared_milli == {"gpu-2": 300}
    fit = ALLOC.allocate(EIGHT, usage, one(gpu_milli=500))  # 400 left on gpu-2: takes a fresh GPU
    assert fit.devices["r"] != ("gpu-2",)
    whole = ALLOC.allocate(EIGHT, usage, one(count=7))
    assert "gpu-2" not in whole.devices["r"]
    spread = Allocator(CelSelectors(), Policy.SPREAD).allocate(EIGHT, usage, one(gpu_milli=300))
    assert spread.devices["r"] != ("gpu-2",)
    no_share = inventory(gpu(0, "A", shareable=False))
    with pytest.raises(NoFit):  # tried: a fraction of a GPU that supports neither time-slicing nor MPS
        ALLOC.allocate(no_share, NodeUsage(), one(gpu_milli=500))


def test_fgd_policy_fills_the_gpu_that_leaves_least_fragment() -> None:
    usage = NodeUsage(shared_milli={"gpu-0": 500, "gpu-1": 250})  # 500 and 750 left
    fgd = Allocator(CelSelectors(), Policy.FGD)
    fit = fgd.allocate(inventory(gpu(0, "A"), gpu(1, "A"), gpu(2, "A")), usage, one(gpu_milli=500))
    assert fit.devices["r"] == ("gpu-0",)  # leaves 0 idle there: no new fragment


def test_mig_takes_an_existing_free_device_first() -> None:
    parent = gpu(0, "A", "NVIDIA A100-SXM4-40GB", 40, mig=True)
    existing = MigDevice("MIG-1", parent.uuid, 0, 0, "1g.5gb", 19, MigPlacement(6, 1), 1, 0, 5 * GiB, 14, 1, 0, 0, 0, 0)
    inv = inventory(parent, mig_devices=(existing,))
    sel = ("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",)
    fit = ALLOC.allocate(inv, NodeUsage(), one(device_class=MIG_CLASS, selectors=sel))
    assert fit.devices["r"] == ("gpu-0-mig-1g5gb-19-6",)


def test_mig_placement_keeps_the_most_future_placements() -> None:
    parent = gpu(0, "A", "NVIDIA A100-SXM4-40GB", 40, mig=True)
    inv = inventory(parent)
    sel = ("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",)
    fit = ALLOC.allocate(inv, NodeUsage(), one(device_class=MIG_CLASS, selectors=sel))
    name = fit.devices["r"][0]
    start = int(name.rsplit("-", 1)[1])
    profile = parent.profile("1g.5gb")
    assert profile is not None
    rooms = {
        s: count_free_placements(parent.mig_profiles, [PlacedProfile.of(profile, MigPlacement(s, 1))]) for s in range(7)
    }
    assert rooms[start] == max(rooms.values())
    # a reserved possible placement counts as occupied: the next one lands elsewhere
    fit2 = ALLOC.allocate(inv, NodeUsage(reserved=frozenset({name})), one(device_class=MIG_CLASS, selectors=sel))
    assert fit2.devices["r"] != (name,)
    with pytest.raises(NoFit):  # tried: a MIG device on an unhealthy parent GPU
        ALLOC.allocate(inv, NodeUsage(unhealthy=frozenset({"gpu-0"})), one(device_class=MIG_CLASS, selectors=sel))
    whole_gpu = ALLOC.allocate(
        inv,
        NodeUsage(),
        one(device_class=MIG_CLASS, count=2, selectors=("device.attributes['gpu.nvidia.com'].profile == '3g.20gb'",)),
    )
    assert sorted(whole_gpu.devices["r"]) == ["gpu-0-mig-3g20gb-9-0", "gpu-0-mig-3g20gb-9-4"]


def test_capacity_summary_and_binpack_scores_the_fuller_node_higher() -> None:
    mig = gpu(8, "C", "NVIDIA A100-SXM4-40GB", 40, mig=True)
    inv = inventory(*EIGHT.gpus, mig)
    s = summarize(inv, NodeUsage(allocated=frozenset({"gpu-0"}), shared_milli={"gpu-1": 250}))
    assert s.free_gpus_by_model == {"NVIDIA H100 80GB HBM3": 6}
    assert s.free_gpus_by_domain == {"A": 2, "B": 4}
    assert s.free_mig_placements["1g.5gb"] == 7 and s.free_mig_placements["7g.40gb"] == 1
    assert s.free_gpu_milli == 6000 + 750
    full = ALLOC.allocate(EIGHT, NodeUsage(allocated=frozenset({"gpu-0", "gpu-1"})), one())
    empty = ALLOC.allocate(EIGHT, NodeUsage(), one())
    assert full.score > empty.score


def test_fgd_policy_prefers_a_node_in_use_over_an_empty_one() -> None:
    fgd = Allocator(CelSelectors(), Policy.FGD)
    used = fgd.allocate(EIGHT, NodeUsage(allocated=frozenset({"gpu-0"})), one())
    empty = fgd.allocate(EIGHT, NodeUsage(), one())
    assert used.score > empty.score


def test_match_attribute_works_on_int_and_version_attributes_too() -> None:
    """Tried: matchAttribute on numaNode (an int) and driverVersion (a version), not only on strings."""
    numa = inventory(
        *(
            Gpu(
                i,
                i,
                f"GPU-{i:04d}",
                "NVIDIA H100 80GB HBM3",
                "Nvidia",
                "Hopper",
                "9.0",
                80 * GiB,
                f"0000:{i:02x}:00.0",
                0x233010DE,
                numa_node=i // 2,
                nvlink_domain="A",
            )
            for i in range(4)
        )
    )
    fit = ALLOC.allocate(
        numa,
        NodeUsage(allocated=frozenset({"gpu-0"})),
        Claim((DeviceRequest("r", count=2),), match_attributes=("gpu.nvidia.com/numaNode",)),
    )
    assert fit.devices["r"] == ("gpu-2", "gpu-3")  # gpu-1 alone is left on NUMA node 0
    fit = ALLOC.allocate(
        EIGHT, NodeUsage(), Claim((DeviceRequest("r", count=2),), match_attributes=("gpu.nvidia.com/driverVersion",))
    )
    assert len(fit.devices["r"]) == 2


def test_gpu_instances_without_compute_instances_block_their_placements() -> None:
    """Tried: a 3g GPU instance at slices 4-7 exists but has no compute instance (so no MIG device)."""
    g = gpu(0, "A", mig=True)
    g = Gpu(**{**g.__dict__, "gpu_instances": (GpuInstance(2, 9, "3g.20gb", MigPlacement(4, 4)),)})
    fit = ALLOC.allocate(
        inventory(g),
        NodeUsage(),
        one(device_class=MIG_CLASS, count=4, selectors=("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",)),
    )
    assert all(int(name.rsplit("-", 1)[1]) < 4 for name in fit.devices["r"])
    with pytest.raises(NoFit):
        ALLOC.allocate(
            inventory(g),
            NodeUsage(),
            one(
                device_class=MIG_CLASS, count=5, selectors=("device.attributes['gpu.nvidia.com'].profile == '1g.5gb'",)
            ),
        )


def test_a_device_taken_under_another_spelling_is_still_taken() -> None:
    # Tried: allocations and prepared claims naming gpu-0..gpu-3 with leading zeros, and a share of gpu-04.
    usage = NodeUsage(
        allocated=frozenset({"gpu-00", "gpu-01"}),
        prepared=frozenset({"gpu-002"}),
        reserved=frozenset({"gpu-03"}),
        shared_milli={"gpu-04": 500},
    )
    assert usage.taken == {"gpu-0", "gpu-1", "gpu-2", "gpu-3"} and usage.shared_milli == {"gpu-4": 500}
    fit = ALLOC.allocate(EIGHT, usage, one(count=3))
    assert set(fit.devices["r"]) == {"gpu-5", "gpu-6", "gpu-7"}
    with pytest.raises(NoFit):  # four whole GPUs, but gpu-4 is half used
        ALLOC.allocate(EIGHT, usage, one(count=4))
