"""ResourceSlice building: what the scheduler and users see for a node's GPUs."""

from __future__ import annotations

import dataclasses
import re

import kubernetes_validate
import pytest

from agent.devices.model import GpuInstance, MigPlacement, MigProfile
from agent.quantity import format_bytes as format_quantity
from agent.quantity import parse as parse_quantity
from agent.slices.build import (
    MAX_DEVICES_PER_SLICE,
    SliceLimitExceeded,
    build_resource_slices,
    counter_set_name,
    natural_key,
    pool_content,
    semver,
    slice_name,
)
from agent.slices.versions import rules_for
from tests.unit.test_slices_factory import H100_MEMORY, dgx_h100, h100, mig_device, nvswitch_inventory
from tests.unit.upstream_slice_rules import VERSIONS, pool_errors

NODE = "node-a"
UID = "0b7a3c8e-1111-2222-3333-444455556666"
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def devices(slices: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


def attr(device: dict, name: str) -> object:
    (value,) = device["attributes"][name].values()
    return value


def validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, "1.34", strict=True)


def test_dgx_h100_is_one_slice_of_eight_gpus_owned_by_the_node() -> None:
    (s,) = build_resource_slices(dgx_h100(), NODE, node_uid=UID, generation=3)
    assert s["apiVersion"] == "resource.k8s.io/v1" and s["kind"] == "ResourceSlice"
    assert s["metadata"]["name"] == "node-a-gpu-nvidia-com-0"
    assert s["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}
    ]
    spec = s["spec"]
    assert spec["driver"] == "gpu.nvidia.com" and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]] == [f"gpu-{i}" for i in range(8)]
    assert "sharedCounters" not in spec
    validate(s)


def test_gpu_attributes_and_memory_follow_the_inventory() -> None:
    inv = dgx_h100()
    by_name = devices(build_resource_slices(inv, NODE))
    for gpu in inv.gpus:
        d = by_name[f"gpu-{gpu.minor}"]
        assert attr(d, "type") == "gpu"
        assert attr(d, "uuid") == gpu.uuid
        assert attr(d, "productName") == "NVIDIA H100 80GB HBM3"
        assert attr(d, "brand") == "Nvidia" and attr(d, "architecture") == "Hopper"
        assert d["attributes"]["cudaComputeCapability"] == {"version": "9.0.0"}
        assert d["attributes"]["driverVersion"] == {"version": "550.54.15"}
        assert d["attributes"]["cudaDriverVersion"] == {"version": "12.4.0"}
        assert attr(d, "resource.kubernetes.io/pciBusID") == gpu.pci_bus_id
        assert attr(d, "resource.kubernetes.io/pcieRoot") == gpu.pcie_root
        assert d["attributes"]["numaNode"] == {"int": gpu.minor // 4}
        assert d["attributes"]["index"] == {"int": gpu.index}
        assert d["attributes"]["minor"] == {"int": gpu.minor}
        assert d["capacity"] == {"memory": {"value": "80Gi"}}
        assert parse_quantity(d["capacity"]["memory"]["value"]) == H100_MEMORY
    domains = {attr(d, "nvlinkDomain") for d in by_name.values()}
    assert len(domains) == 1 and domains.pop() == inv.gpus[0].nvlink_domain


def test_unknown_pcie_root_and_numa_are_left_out_not_invented() -> None:
    inv = nvswitch_inventory([h100(0, pcie_root=None, numa_node=None)])
    (d,) = devices(build_resource_slices(inv, NODE)).values()
    assert "resource.kubernetes.io/pcieRoot" not in d["attributes"]
    assert "numaNode" not in d["attributes"]


def test_driver_versions_become_semver() -> None:
    assert semver("9.0") == "9.0.0"
    assert semver("550.54.15") == "550.54.15"
    assert semver("535.104.05") == "535.104.5"  # semver forbids leading zeros
    assert semver("12") == "12.0.0"
    assert semver("r550-beta") is None
    inv = dataclasses.replace(nvswitch_inventory([h100(0)]), driver_version="weird")
    (d,) = devices(build_resource_slices(inv, NODE)).values()
    assert "driverVersion" not in d["attributes"]  # an unparsable version is omitted, not published wrong
    validate(build_resource_slices(inv, NODE)[0])


def test_mig_enabled_gpu_is_advertised_only_through_its_mig_devices() -> None:
    gpu0 = h100(0, mig_enabled=True)
    migs = (mig_device(gpu0, "1g.10gb", 0, gi_id=9), mig_device(gpu0, "3g.40gb", 4, gi_id=2))
    inv = nvswitch_inventory([gpu0, h100(1)], migs=migs)
    slices = build_resource_slices(inv, NODE)
    by_name = devices(slices)
    assert list(by_name) == ["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-3g40gb-9-4", "gpu-1"]
    small = by_name["gpu-0-mig-1g10gb-19-0"]
    assert attr(small, "type") == "mig"
    assert attr(small, "parentUUID") == gpu0.uuid
    assert attr(small, "profile") == "1g.10gb"
    assert attr(small, "uuid") == migs[0].uuid
    assert attr(small, "productName") == gpu0.product_name
    assert small["capacity"] == {
        "multiprocessors": {"value": "16"},
        "copyEngines": {"value": "1"},
        "decoders": {"value": "1"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "1"},
        "ofaEngines": {"value": "0"},
        "memory": {"value": "9984Mi"},
    }
    validate(slices[0])


def test_more_than_128_devices_split_into_slices_of_one_generation() -> None:
    gpus = [h100(i, nvlink_peers=()) for i in range(200)]
    inv = nvswitch_inventory(gpus[:1])
    inv = dataclasses.replace(inv, gpus=tuple(gpus))
    slices = build_resource_slices(inv, NODE, generation=7)
    assert [len(s["spec"]["devices"]) for s in slices] == [MAX_DEVICES_PER_SLICE, 72]
    assert [s["metadata"]["name"] for s in slices] == ["node-a-gpu-nvidia-com-0", "node-a-gpu-nvidia-com-1"]
    assert all(s["spec"]["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 2} for s in slices)
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == [f"gpu-{i}" for i in range(200)]  # numeric order: gpu-2 before gpu-10
    for s in slices:
        validate(s)


def test_device_order_does_not_depend_on_discovery_order() -> None:
    inv = dgx_h100()
    shuffled = dataclasses.replace(inv, gpus=tuple(reversed(inv.gpus)))
    assert build_resource_slices(shuffled, NODE) == build_resource_slices(inv, NODE)
    assert sorted(["gpu-10", "gpu-9", "gpu-1-mig-1g10gb-19-0", "gpu-1"], key=natural_key) == [
        "gpu-1",
        "gpu-1-mig-1g10gb-19-0",
        "gpu-9",
        "gpu-10",
    ]


def test_pool_content_compares_equal_until_the_inventory_changes() -> None:
    assert pool_content(dgx_h100()) == pool_content(dgx_h100())
    assert pool_content(dgx_h100()) != pool_content(dgx_h100(memory_bytes=H100_MEMORY // 2))


def test_slice_names_stay_valid_for_the_longest_node_names() -> None:
    node = ".".join(["a" * 63] * 4)[:253]
    name = slice_name(node, "gpu.nvidia.com", 12)
    assert len(name) <= 253 and DNS_SUBDOMAIN.match(name)
    assert name.endswith("-gpu-nvidia-com-12")
    assert slice_name(node, "gpu.nvidia.com", 12) != slice_name(node[:-1] + "b", "gpu.nvidia.com", 12)


def test_no_owner_reference_without_the_node_uid() -> None:
    (s,) = build_resource_slices(dgx_h100(), NODE)
    assert "ownerReferences" not in s["metadata"]


def test_quantities_round_trip() -> None:
    for value in (0, 1, 16, 1000, 1536, 9984 * 2**20, H100_MEMORY, 2**50 * 3):
        assert parse_quantity(format_quantity(value)) == value
    assert parse_quantity("80Gi") == parse_quantity("85899345920") == parse_quantity("85899345920e0")
    assert parse_quantity("16k") == 16000
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity("80 GB")  # a human spelling, not a quantity


# --- partitionable --------------------------------------------------------------------------------------


def counters(values: dict) -> dict[str, float]:
    return {k: parse_quantity(v["value"]) for k, v in values.items()}


def consumption(device: dict) -> dict[str, float]:
    (entry,) = device["consumesCounters"]
    return counters(entry["counters"])


def budgets(slices: list[dict]) -> dict[str, dict[str, float]]:
    """Counter set name -> its counters, wherever in the pool the set is published."""
    return {c["name"]: counters(c["counters"]) for s in slices for c in s["spec"].get("sharedCounters", [])}


@pytest.mark.parametrize("version", VERSIONS)
def test_partitionable_gpu_is_one_counter_set_consumed_whole_by_the_full_gpu(version: str) -> None:
    slices = build_resource_slices(dgx_h100(), NODE, partitionable=True, node_uid=UID, rules=rules_for(version))
    assert pool_errors(slices, version) == []
    if version == "1.34":  # counters beside the devices that consume them: one slice per GPU
        assert len(slices) == 8
        assert [[c["name"] for c in s["spec"]["sharedCounters"]] for s in slices] == [
            [counter_set_name(i)] for i in range(8)
        ]
    else:  # 1.35+: the eight counter sets in a slice of their own, then one slice of devices per GPU
        assert len(slices) == 9
        assert "devices" not in slices[0]["spec"]
        assert [c["name"] for c in slices[0]["spec"]["sharedCounters"]] == [counter_set_name(i) for i in range(8)]
        assert all("sharedCounters" not in s["spec"] for s in slices[1:])
    sets = budgets(slices)
    by_name = devices(slices)
    for minor in range(8):
        budget = sets[f"gpu-{minor}-counter-set"]
        assert {f"memory-slice-{i}" for i in range(8)} <= budget.keys()
        assert budget["memory"] == H100_MEMORY and budget["multiprocessors"] == 132
        whole = by_name[f"gpu-{minor}"]
        assert whole["consumesCounters"][0]["counterSet"] == counter_set_name(minor)
        assert consumption(whole) == budget


@pytest.mark.parametrize("version", VERSIONS)
def test_every_possible_placement_is_a_device_within_the_budget(version: str) -> None:
    slices = build_resource_slices(dgx_h100(), NODE, partitionable=True, rules=rules_for(version))
    budget = budgets(slices)["gpu-0-counter-set"]
    gpu = h100(0)

    def name(p: MigProfile, pl: MigPlacement) -> str:
        return f"gpu-0-mig-{p.name.replace('.', '').replace('+', '-')}-{p.gi_profile_id}-{pl.start}"

    expected = {name(p, pl) for p in gpu.mig_profiles for pl in p.placements}
    by_name = {n: d for n, d in devices(slices).items() if n == "gpu-0" or n.startswith("gpu-0-")}
    assert by_name.keys() == expected | {"gpu-0"}
    for profile in gpu.mig_profiles:
        for pl in profile.placements:
            d = by_name[name(profile, pl)]
            used = consumption(d)
            assert "uuid" not in d["attributes"]  # not created yet
            assert {k for k in used if k.startswith("memory-slice-")} == {f"memory-slice-{i}" for i in pl.slices}
            assert all(used[k] <= budget[k] for k in used)
    # Real layouts fit at once: seven 1g.10gb, or 3g.40gb + 4g.40gb, or 2g + 2g + 3g.
    for layout in (
        [f"gpu-0-mig-1g10gb-19-{i}" for i in range(7)],
        ["gpu-0-mig-4g40gb-5-0", "gpu-0-mig-3g40gb-9-4"],
        ["gpu-0-mig-2g20gb-14-0", "gpu-0-mig-2g20gb-14-2", "gpu-0-mig-3g40gb-9-4"],
    ):
        total: dict[str, float] = {}
        for name in layout:
            for k, v in consumption(by_name[name]).items():
                total[k] = total.get(k, 0) + v
        assert all(total[k] <= budget[k] for k in total), layout


def test_overlapping_placements_and_instance_limits_are_exclusive_through_counters() -> None:
    slices = build_resource_slices(dgx_h100(), NODE, partitionable=True)
    budget = budgets(slices)["gpu-0-counter-set"]
    by_name = {n: consumption(d) for n, d in devices(slices).items()}

    def fits(*names: str) -> bool:
        return all(sum(by_name[n].get(k, 0) for n in names) <= v for k, v in budget.items())

    assert not fits("gpu-0", "gpu-0-mig-1g10gb-19-3")  # the whole GPU excludes any MIG device
    assert not fits("gpu-0-mig-1g20gb-15-2", "gpu-0-mig-1g10gb-19-3")  # slices 2-3 overlap 3
    assert fits("gpu-0-mig-1g20gb-15-2", "gpu-0-mig-1g10gb-19-4")
    # 1g.10gb+me exists at most once per GPU though seven placements are disjoint.
    assert not fits("gpu-0-mig-1g10gb-me-20-0", "gpu-0-mig-1g10gb-me-20-1")


@pytest.mark.parametrize("version", VERSIONS)
def test_partitionable_gpu_with_existing_instances_keeps_them_and_drops_conflicts(version: str) -> None:
    gpu0 = h100(0, mig_enabled=True, gpu_instances=(GpuInstance(5, 9, "3g.40gb", MigPlacement(4, 4)),))
    mig = mig_device(gpu0, "1g.10gb", 0, gi_id=9)
    inv = nvswitch_inventory([gpu0], migs=(mig,))
    slices = build_resource_slices(inv, NODE, partitionable=True, rules=rules_for(version))
    assert pool_errors(slices, version) == []
    by_name = devices(slices)
    assert "gpu-0" not in by_name  # MIG instances exist: no whole GPU
    assert attr(by_name["gpu-0-mig-1g10gb-19-0"], "uuid") == mig.uuid
    assert "gpu-0-mig-1g10gb-me-20-0" not in by_name  # overlaps the existing device
    assert "gpu-0-mig-1g10gb-19-5" not in by_name  # overlaps the instance without a device
    assert "gpu-0-mig-2g20gb-14-2" in by_name


@pytest.mark.parametrize("version", VERSIONS)
def test_a_gpu_filled_by_instances_without_devices_offers_nothing_and_does_not_break_the_pool(version: str) -> None:
    """Tried: a 7g GPU instance created without its compute instance (`nvidia-smi mig -cgi` without -C)."""
    gpu0 = h100(0, mig_enabled=True, gpu_instances=(GpuInstance(0, 0, "7g.80gb", MigPlacement(0, 8)),))
    inv = nvswitch_inventory([gpu0, h100(1)])
    slices = build_resource_slices(inv, NODE, partitionable=True, rules=rules_for(version))
    names = list(devices(slices))
    assert "gpu-1" in names
    assert not [n for n in names if n.startswith("gpu-0")]  # the full GPU instance leaves no room
    assert "gpu-0-counter-set" not in budgets(slices)
    assert pool_errors(slices, version) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_non_mig_gpus_stay_plain_in_partitionable_mode(version: str) -> None:
    inv = nvswitch_inventory([h100(0), h100(1, mig_capable=False, mig_profiles=())])
    slices = build_resource_slices(inv, NODE, partitionable=True, rules=rules_for(version))
    assert pool_errors(slices, version) == []
    assert list(budgets(slices)) == ["gpu-0-counter-set"]
    plain = slices[-1]["spec"]
    assert [d["name"] for d in plain["devices"]] == ["gpu-1"] and "sharedCounters" not in plain
    assert "consumesCounters" not in plain["devices"][0]


def tiny_profiles(count: int, slices: int = 8) -> tuple[MigProfile, ...]:
    """`count` one-slice profiles (distinct ids) with a placement on every memory slice."""
    return tuple(
        MigProfile(
            f"1g.{i + 1}gb",
            i,
            100 + i,
            1,
            1,
            slices,
            1024,
            1,
            1,
            0,
            0,
            0,
            0,
            tuple(MigPlacement(p, 1) for p in range(slices)),
        )
        for i in range(count)
    )


def test_a_gpu_with_more_counters_than_a_set_holds_is_refused_on_every_version() -> None:
    """Tried: 80 memory slices, i.e. 80 memory-slice counters; a counter set holds 32 (1.34: a slice does)."""
    inv = nvswitch_inventory([h100(0, mig_profiles=tiny_profiles(1, slices=80))])
    for version in VERSIONS:
        with pytest.raises(SliceLimitExceeded, match=f"counters; Kubernetes {version} allows 32"):
            build_resource_slices(inv, NODE, partitionable=True, rules=rules_for(version))


@pytest.mark.parametrize("version", VERSIONS)
def test_more_than_64_partitionable_devices_of_one_gpu_split_from_1_35(version: str) -> None:
    """73 devices of one GPU: one slice on 1.34 (128 allowed), two on 1.35+ (64 where counters are consumed),
    both consuming the counter set that 1.35+ publishes in a slice of its own."""
    inv = nvswitch_inventory([h100(0, mig_profiles=tiny_profiles(9))])
    slices = build_resource_slices(inv, NODE, partitionable=True, rules=rules_for(version), generation=4)
    assert pool_errors(slices, version) == []
    sizes = [len(s["spec"].get("devices", [])) for s in slices]
    assert sizes == ([73] if version == "1.34" else [0, 64, 9])
    assert {s["spec"]["pool"]["generation"] for s in slices} == {4}
    assert len(devices(slices)) == 73


def test_gpus_past_eight_counter_sets_take_a_second_counter_slice() -> None:
    inv = nvswitch_inventory([h100(i, nvlink_peers=()) for i in range(10)])
    slices = build_resource_slices(inv, NODE, partitionable=True, rules=rules_for("1.37"))
    assert pool_errors(slices, "1.37") == []
    assert [len(s["spec"].get("sharedCounters", [])) for s in slices[:2]] == [8, 2]
    assert len(slices) == 12
