"""The slice shape follows the server's Kubernetes version: limits, counter placement, device taints."""

from __future__ import annotations

import dataclasses

import pytest

from agent.slices.build import build_resource_slices
from agent.slices.taints import gpu_lost_taint, xid_taint
from agent.slices.versions import LATEST, RULES, UnknownServerVersion, parse_version, rules_for
from agent.times import rfc3339
from tests.unit.test_slices_factory import dgx_h100, h100, mig_device, nvswitch_inventory
from tests.unit.upstream_slice_rules import VERSIONS, pool_errors, slice_errors

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
NOW = 1_795_000_000.0  # 2026-11-18


def test_server_versions_pick_their_rules() -> None:
    assert parse_version("v1.36.2") == (1, 36)
    assert parse_version("v1.37.0-rc.1+0123abc") == (1, 37)
    assert parse_version("1.35") == (1, 35)
    assert rules_for("v1.34.10") is RULES[(1, 34)]
    assert rules_for("v1.38.0") is LATEST  # newer than known: the newest rules
    assert rules_for("v1.33.5") is RULES[(1, 34)]
    with pytest.raises(UnknownServerVersion, match="'latest' is not of the form"):
        parse_version("latest")


@pytest.mark.parametrize("version", VERSIONS)
def test_the_agents_device_limits_are_upstreams_exactly(version: str) -> None:
    """A slice at the agent's limit passes upstream's rules; one device more fails (so neither number is
    looser or stricter than upstream's)."""
    rules = rules_for(version)
    gpus = tuple(h100(i, nvlink_peers=()) for i in range(300))
    inv = dataclasses.replace(nvswitch_inventory(gpus[:1]), gpus=gpus)
    (first, *_) = build_resource_slices(inv, NODE, rules=rules)
    assert len(first["spec"]["devices"]) == rules.max_devices == 128
    assert slice_errors(first, version) == []
    over = {
        **first,
        "spec": {
            **first["spec"],
            "devices": [*first["spec"]["devices"], first["spec"]["devices"][0] | {"name": "gpu-extra"}],
        },
    }
    assert slice_errors(over, version) != []

    taint = xid_taint(DRIVER, 79, NOW)
    tainted = {f"gpu-{i}": [taint] for i in range(300)}
    slices = build_resource_slices(inv, NODE, rules=rules, taints=tainted)
    if rules.taints_served:
        assert len(slices[0]["spec"]["devices"]) == rules.max_devices_advanced == 64
        assert all(d["taints"] == [taint] for s in slices for d in s["spec"]["devices"])
        grown = {
            **slices[0],
            "spec": {**slices[0]["spec"], "devices": [*slices[0]["spec"]["devices"], over["spec"]["devices"][-1]]},
        }
        assert slice_errors(grown, version) != []  # 65 with a taint among them
    else:
        assert len(slices[0]["spec"]["devices"]) == 128
        assert not any("taints" in d for s in slices for d in s["spec"]["devices"])
    assert pool_errors(slices, version) == []


@pytest.mark.parametrize("version", VERSIONS)
def test_a_tainted_gpu_taints_everything_carved_from_it_where_taints_are_served(version: str) -> None:
    """Tried: Xid 79 on GPU 0 of a DGX H100 with partitionable devices, and GPU 3 lost."""
    rules = rules_for(version)
    taints = {"gpu-0": [xid_taint(DRIVER, 79, NOW)], "gpu-3": [gpu_lost_taint(DRIVER, NOW)]}
    slices = build_resource_slices(dgx_h100(), NODE, partitionable=True, rules=rules, taints=taints)
    assert pool_errors(slices, version) == []
    devices = {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}
    if not rules.taints_served:  # 1.34-1.35: the agent withdraws unhealthy devices instead
        assert not any("taints" in d for d in devices.values())
        return
    of_gpu0 = [d for n, d in devices.items() if n == "gpu-0" or n.startswith("gpu-0-")]
    assert len(of_gpu0) > 20
    for device in of_gpu0:
        assert device["taints"] == [
            {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule", "timeAdded": rfc3339(NOW)}
        ]
    assert devices["gpu-3"]["taints"] == [
        {"key": "gpu.nvidia.com/gpu-lost", "effect": "NoSchedule", "timeAdded": "2026-11-18T11:06:40Z"}
    ]
    assert "taints" not in devices["gpu-1"]


def test_a_mig_device_keeps_its_own_taint_beside_its_gpus() -> None:
    gpu0 = h100(0, mig_enabled=True)
    migs = (mig_device(gpu0, "1g.10gb", 0, gi_id=9), mig_device(gpu0, "1g.10gb", 1, gi_id=10))
    taints = {migs[0].name: [xid_taint(DRIVER, 94, NOW)]}
    slices = build_resource_slices(nvswitch_inventory([gpu0], migs=migs), NODE, rules=rules_for("1.37"), taints=taints)
    by_name = {d["name"]: d for s in slices for d in s["spec"]["devices"]}
    assert by_name[migs[0].name]["taints"][0]["value"] == "94"
    assert "taints" not in by_name[migs[1].name]
    assert pool_errors(slices, "1.37") == []
