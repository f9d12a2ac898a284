"""Which layout a config asks of each GPU, and the plan from any layout to it.

The property test walks every MIG-capable machine profile of the fake and every pair of the GPU Operator's
configs that applies to its product: from any layout realising the first (placements anywhere, some GPU
instances without compute instances, MIG mode off) the plan reaches the second, every step checked by an
independent model of NVML's rules (memory slices, instance limits, compute slices), so a create never meets
InsufficientResources. Planning again from the result plans nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.devices.geometry import PlacedProfile
from agent.devices.model import Gpu, GpuInstance, Inventory, MigDevice, MigPlacement, MigProfile
from agent.migconfig.desired import ConfigRefused, WantedLayout, wanted_layouts
from agent.migconfig.files import load_mig_configs
from agent.migconfig.plan import GpuPlan, LayoutDoesNotFit, choose_layout, plan_gpu, plan_node
from agent.migconfig.spec import parse_mig_configs
from agent.nvml.source import open_nvml
from fakes.nvml import MACHINES

CONFIGS = load_mig_configs()
MIG_MACHINES = sorted(name for name, m in MACHINES.items() if any(g.product.mig_capable for g in m.gpus))


@functools.cache
def inventory(machine: str) -> Inventory:
    with open_nvml(f"fake:{machine}") as nvml:
        return nvml.discover()


def gpu0(machine: str) -> Gpu:
    return next(g for g in inventory(machine).gpus if g.mig_capable)


# --- which GPUs a config covers ---------------------------------------------------------------------


def test_all_1g10gb_means_seven_on_h100_and_four_on_a100_40gb() -> None:
    h100 = wanted_layouts(CONFIGS, "all-1g.10gb", inventory("dgx-h100"))
    a100 = wanted_layouts(CONFIGS, "all-1g.10gb", inventory("dgx-a100-40gb"))
    assert set(h100) == set(a100) == set(range(8))
    assert {w.devices for w in h100.values()} == {(("1g.10gb", 7),)}
    assert {w.devices for w in a100.values()} == {(("1g.10gb", 4),)}


def test_unknown_config_name_is_refused_with_the_names_known() -> None:
    with pytest.raises(ConfigRefused, match=r"unknown MIG config 'all-2g\.99gb': the config file has 81 configs"):
        wanted_layouts(CONFIGS, "all-2g.99gb", inventory("dgx-h100"))


def test_a_profile_the_gpu_lacks_is_refused_naming_gpu_and_profiles() -> None:
    with pytest.raises(ConfigRefused) as err:
        wanted_layouts(CONFIGS, "all-1g.5gb", inventory("dgx-h100"))
    assert "profile 1g.5gb on GPU 0 (NVIDIA H100 80GB HBM3), which has only 1g.10gb" in str(err.value)


def test_gpus_without_mig_are_skipped_under_all_and_refused_by_index() -> None:
    assert wanted_layouts(CONFIGS, "all-1g.10gb", inventory("l40s-x2")) == {}
    named = parse_mig_configs("version: v1\nmig-configs:\n  x:\n    - devices: [1]\n      mig-enabled: false\n")
    with pytest.raises(ConfigRefused, match=r"names GPU 1 \(NVIDIA L40S\), which cannot do MIG"):
        wanted_layouts(named, "x", inventory("l40s-x2"))


def test_last_covering_entry_decides_and_uncovered_gpus_are_left_alone() -> None:
    configs = parse_mig_configs(
        """
version: v1
mig-configs:
  split:
    - devices: [0, 1, 2]
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
    - devices: [2]
      mig-enabled: false
"""
    )
    wanted = wanted_layouts(configs, "split", inventory("dgx-h100"))
    assert wanted == {
        0: WantedLayout(True, (("7g.80gb", 1),)),
        1: WantedLayout(True, (("7g.80gb", 1),)),
        2: WantedLayout(False),
    }


def test_dynamic_mig_takes_the_mode_and_refuses_static_instances() -> None:
    inv = inventory("dgx-h100")
    wanted = wanted_layouts(CONFIGS, "all-enabled", inv, partitionable=True)
    assert set(wanted.values()) == {WantedLayout(True, mode_only=True)}
    with pytest.raises(ConfigRefused, match="with --partitionable-devices MIG devices are created per claim"):
        wanted_layouts(CONFIGS, "all-1g.10gb", inv, partitionable=True)


def test_dynamic_mig_keeps_the_instances_claims_made_while_mig_stays_on() -> None:
    inv = inventory("mixed-mig")  # GPUs 0-1 hold instances (as if claims had made them), 2-3 MIG off
    enabled = plan_node(inv, wanted_layouts(CONFIGS, "all-enabled", inv, partitionable=True))
    assert [(p.destroy, p.create, p.mig_mode) for p in enabled] == [((), (), None)] * 2 + [((), (), True)] * 2
    disabled = plan_node(inv, wanted_layouts(CONFIGS, "all-disabled", inv, partitionable=True))
    assert [len(p.destroy) for p in disabled] == [4, 4, 0, 0]  # waits for their claims, then goes


# --- plans ------------------------------------------------------------------------------------------


def test_a_layout_that_already_matches_plans_nothing() -> None:
    inv = inventory("mixed-mig")  # GPUs 0-1: all-balanced as mig-parted made it; 2-3: MIG off
    plans = plan_node(inv, wanted_layouts(CONFIGS, "all-balanced", inv))
    assert [p.changes for p in plans] == [False, False, True, True]
    plans = plan_node(inv, wanted_layouts(CONFIGS, "all-disabled", inv))
    assert [p.changes for p in plans] == [True, True, False, False]


def test_disabling_destroys_every_instance_then_switches_mode_off() -> None:
    inv = inventory("mixed-mig")
    plan = plan_node(inv, wanted_layouts(CONFIGS, "all-disabled", inv))[0]
    assert plan.mig_mode is False and plan.create == ()
    assert sorted(p.profile for p in plan.destroy) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]


def test_instances_that_fit_the_new_layout_stay() -> None:
    """all-balanced (3g+2g+1g+1g) -> all-1g.10gb: the two 1g instances stay where they are."""
    inv = inventory("mixed-mig")
    before = {(m.placement.start, m.profile) for m in inv.mig_devices_of(0)}
    plan = plan_node(inv, wanted_layouts(CONFIGS, "all-1g.10gb", inv))[0]
    assert sorted(p.profile for p in plan.destroy) == ["2g.20gb", "3g.40gb"]
    assert len(plan.create) == 5 and plan.mig_mode is None
    kept = {(p.start, p.profile) for p in plan.layout} - {(p.start, p.profile) for p in plan.create}
    assert kept == {s for s in before if s[1] == "1g.10gb"}
    assert len(kept) == 2


def test_gpu_instances_without_a_whole_compute_instance_are_recreated() -> None:
    """A crash between creating a GPU instance and its compute instance leaves a bare GI: re-made, not kept."""
    inv = inventory("mixed-mig")
    gpu = inv.gpus[0]
    bare = next(m for m in inv.mig_devices_of(0) if m.profile == "3g.40gb")
    devices = [m for m in inv.mig_devices_of(0) if m is not bare]
    plan = plan_gpu(gpu, devices, wanted_layouts(CONFIGS, "all-balanced", inv)[0])
    assert [(p.profile, p.start) for p in plan.destroy] == [("3g.40gb", bare.placement.start)]
    assert [(p.profile, p.start) for p in plan.create] == [("3g.40gb", bare.placement.start)]


def test_pending_mode_is_corrected_even_when_current_mode_is_right() -> None:
    """An A100 with MIG off but an enable pending (set by hand, no reset yet): all-disabled sets it back."""
    gpu = dataclasses.replace(gpu0("dgx-a100-40gb"), mig_enabled=False, mig_pending=True)
    plan = plan_gpu(gpu, [], WantedLayout(False))
    assert plan.mig_mode is False and plan.changes


def test_instances_that_cannot_coexist_do_not_fit() -> None:
    gpu = gpu0("dgx-h100")
    with pytest.raises(LayoutDoesNotFit, match=r"GPU 0 \(NVIDIA H100 80GB HBM3\) cannot hold 8x 1g.10gb at once"):
        plan_gpu(gpu, [], WantedLayout(True, (("1g.10gb", 8),)))
    with pytest.raises(LayoutDoesNotFit, match="cannot hold"):
        plan_gpu(gpu, [], WantedLayout(True, (("4g.40gb", 1), ("7g.80gb", 1))))


def test_order_that_auto_placement_gets_wrong_is_placed_explicitly() -> None:
    """The MIG guide's `-cgi 19,19,14,9` fails by auto-placement; explicit placements always fit."""
    gpu = gpu0("dgx-a100-40gb")
    plan = plan_gpu(gpu, [], WantedLayout(True, (("1g.5gb", 2), ("2g.10gb", 1), ("3g.20gb", 1))))
    assert model_apply(gpu, set(), plan) == set(plan.layout)
    assert [p.profile for p in plan.create][0] == "3g.20gb"


# --- the property: any two operator layouts reach each other ----------------------------------------


@functools.cache
def applicable(machine: str) -> tuple[str, ...]:
    """The operator's configs this machine's first MIG GPU can hold."""
    gpu = gpu0(machine)
    single = dataclasses.replace(inventory(machine), gpus=(gpu,), mig_devices=())
    out = []
    for name in CONFIGS.names():
        try:
            wanted = wanted_layouts(CONFIGS, name, single)
            if gpu.minor in wanted:
                plan_gpu(gpu, [], wanted[gpu.minor])
                out.append(name)
        except (ConfigRefused, LayoutDoesNotFit):
            pass
    return tuple(out)


@functools.cache
def realisations(machine: str, config: str) -> tuple[tuple[PlacedProfile, ...], ...]:
    """Every layout with the config's instances: where mig-parted's auto-placement (or anyone) may have
    put them."""
    gpu = gpu0(machine)
    wanted = wanted_layouts(CONFIGS, config, dataclasses.replace(inventory(machine), gpus=(gpu,)))[gpu.minor]
    profiles = [gpu.profile(n) for n, c in wanted.devices for _ in range(c)]
    found: set[tuple[PlacedProfile, ...]] = set()

    def walk(i: int, chosen: list[PlacedProfile]) -> None:
        if i == len(profiles):
            found.add(tuple(sorted(chosen)))
            return
        p = profiles[i]
        assert p is not None
        floor = max((c.start for c in chosen if c.gi_profile_id == p.gi_profile_id), default=-1)
        for pl in p.placements:
            cand = PlacedProfile.of(p, pl)
            if cand.start <= floor:
                continue  # the same set reached in another order
            if model_fits(gpu, chosen, cand):
                walk(i + 1, [*chosen, cand])

    walk(0, [])
    return tuple(sorted(found)) if wanted.mig_enabled else ((),)


def model_fits(gpu: Gpu, layout: Sequence[PlacedProfile], new: PlacedProfile) -> bool:
    """NVML's rules, written out apart from agent.devices.geometry: the placement is one of the profile's,
    its memory slices are free, the profile is under its instance limit and compute slices remain."""
    profile = gpu.profile(new.gi_profile_id)
    assert profile is not None
    if MigPlacement(new.start, new.size) not in profile.placements:
        return False
    used = {s for p in layout for s in range(p.start, p.start + p.size)}
    if used & set(range(new.start, new.start + new.size)):
        return False
    if sum(1 for p in layout if p.gi_profile_id == new.gi_profile_id) >= profile.max_instances:
        return False
    return sum(p.compute_slices for p in layout) + new.compute_slices <= 7


def model_apply(gpu: Gpu, layout: set[PlacedProfile], plan: GpuPlan) -> set[PlacedProfile]:
    """Run a plan on the model: destroys must name existing instances, creates must fit."""
    state = set(layout)
    for p in plan.destroy:
        assert p in state, f"destroys {p}, which is not there"
        state.remove(p)
    if plan.mig_mode is False:
        assert not state and not plan.create
    for p in plan.create:
        assert model_fits(gpu, sorted(state), p), f"{plan.describe()}: creating {p} would be InsufficientResources"
        state.add(p)
    return state


def as_discovered(
    gpu: Gpu, layout: Sequence[PlacedProfile], bare: Sequence[bool], enabled: bool
) -> tuple[Gpu, list[MigDevice]]:
    """The GPU as discovery reports it with this layout; `bare` GIs have no compute instance."""
    instances, devices = [], []
    for gi_id, (p, no_ci) in enumerate(zip(layout, bare, strict=True), start=1):
        profile = gpu.profile(p.gi_profile_id)
        assert isinstance(profile, MigProfile)
        instances.append(GpuInstance(gi_id, p.gi_profile_id, p.profile, p.placement))
        if not no_ci:
            devices.append(mig_device(gpu, gi_id, profile, p))
    discovered = dataclasses.replace(
        gpu, mig_enabled=enabled, mig_pending=enabled, gpu_instances=tuple(instances) if enabled else ()
    )
    return discovered, devices if enabled else []


def mig_device(gpu: Gpu, gi_id: int, profile: MigProfile, p: PlacedProfile) -> MigDevice:
    return MigDevice(
        uuid=f"MIG-{gi_id}",
        parent_uuid=gpu.uuid,
        parent_minor=gpu.minor,
        parent_index=gpu.index,
        profile=profile.name,
        gi_profile_id=profile.gi_profile_id,
        placement=p.placement,
        gpu_instance_id=gi_id,
        compute_instance_id=0,
        memory_bytes=profile.memory_bytes,
        multiprocessors=profile.multiprocessors,
        copy_engines=profile.copy_engines,
        decoders=profile.decoders,
        encoders=profile.encoders,
        jpeg_engines=profile.jpeg_engines,
        ofa_engines=profile.ofa_engines,
    )


@st.composite
def transitions(draw: st.DrawFn) -> tuple[str, str, str, tuple[PlacedProfile, ...], tuple[bool, ...]]:
    machine = draw(st.sampled_from(MIG_MACHINES))
    configs = applicable(machine)
    start, goal = draw(st.sampled_from(configs)), draw(st.sampled_from(configs))
    layout = draw(st.sampled_from(realisations(machine, start)))
    bare = tuple(draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout))))
    return machine, start, goal, layout, bare


def test_every_machine_profile_has_configs_to_walk() -> None:
    assert len(MIG_MACHINES) >= 6
    for machine in MIG_MACHINES:
        assert {"all-disabled", "all-enabled", "all-balanced"} <= set(applicable(machine)), machine
        assert len(applicable(machine)) >= 9, machine


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transitions())
def test_any_two_operator_layouts_reach_each_other(
    case: tuple[str, str, str, tuple[PlacedProfile, ...], tuple[bool, ...]],
) -> None:
    machine, start, goal, layout, bare = case
    gpu = gpu0(machine)
    enabled = bool(CONFIGS.get(start) and any(s.mig_enabled for s in CONFIGS.get(start) or ()))
    here, devices = as_discovered(gpu, layout, bare, enabled or bool(layout))
    single = dataclasses.replace(inventory(machine), gpus=(gpu,))
    wanted = wanted_layouts(CONFIGS, goal, single)[gpu.minor]

    plan = plan_gpu(here, devices, wanted)
    result = model_apply(gpu, set(layout) if here.mig_enabled else set(), plan)

    assert Counter(p.profile for p in result) == Counter({n: c for n, c in wanted.devices})
    assert result == set(plan.layout)
    assert plan.mig_mode in (None, wanted.mig_enabled)
    kept = set(layout) - set(plan.destroy)
    assert not any(b and p in kept for p, b in zip(layout, bare, strict=True)), "a bare GI was kept"
    # Done: planning again from what the plan made changes nothing.
    after, after_devices = as_discovered(gpu, sorted(result), [False] * len(result), wanted.mig_enabled)
    assert not plan_gpu(after, after_devices, wanted).changes


def test_choose_layout_keeps_the_most_it_can() -> None:
    gpu = gpu0("dgx-h100")
    p1, p2, p3 = (gpu.profile(n) for n in ("1g.10gb", "2g.20gb", "3g.40gb"))
    assert p1 and p2 and p3
    # A 1g at 2 and a 2g at 0 exist; 3g + 2g + 1g keeps both only with the 3g at 4 (the first try is 0).
    keep = [PlacedProfile.of(p1, MigPlacement(2, 1)), PlacedProfile.of(p2, MigPlacement(0, 2))]
    layout = choose_layout(gpu.mig_profiles, [p3, p2, p1], keep)
    assert layout is not None and set(keep) <= set(layout)
    assert {(p.profile, p.start) for p in layout} == {("3g.40gb", 4), ("2g.20gb", 0), ("1g.10gb", 2)}
