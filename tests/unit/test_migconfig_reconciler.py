"""The label flow against the NVML fake, with the node agent's hooks recorded: the state label and Events a
user sees, which GPUs leave and return to the slices, and what NVML was asked to change."""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import pynvml
import pytest

from agent.devices.model import Gpu
from agent.kube.errors import ApiError
from agent.migconfig.applying import apply_plan
from agent.migconfig.desired import ConfigRefused, wanted_layouts
from agent.migconfig.files import load_mig_configs
from agent.migconfig.plan import LayoutDoesNotFit, plan_node
from agent.migconfig.reconciler import CONFIG_LABEL, MigReconciler, MigState, NodeHooks
from agent.nvml.migmode import MigReconfiguration
from agent.nvml.source import NvmlSource, open_nvml

CONFIGS = load_mig_configs()


@dataclass
class Report:
    labels: list[dict[str, str | None]] = field(default_factory=list)
    events: list[tuple[str, str, str]] = field(default_factory=list)

    def set_labels(self, labels: dict[str, str | None]) -> None:
        self.labels.append(labels)

    def event(self, event_type: str, reason: str, message: str) -> None:
        self.events.append((event_type, reason, message))

    @property
    def states(self) -> list[str | None]:
        return [d.get("nvidia.com/mig.config.state") for d in self.labels]


class CountingSteps(MigReconfiguration):
    """The real NVML steps, counting the calls that change something."""

    def __init__(self) -> None:
        super().__init__()
        self.changes: Counter[str] = Counter()

    def create(self, parent: int | str, gi_profile_id: int, start: int):  # type: ignore[no-untyped-def]
        self.changes["create"] += 1
        return super().create(parent, gi_profile_id, start)

    def destroy_at(self, parent: int | str, gi_profile_id: int, start: int) -> bool:
        self.changes["destroy"] += 1
        return super().destroy_at(parent, gi_profile_id, start)

    def set_mig_mode(self, parent: str, enabled: bool) -> tuple[bool, str]:
        self.changes["mode"] += 1
        return super().set_mig_mode(parent, enabled)


class Flow:
    """A reconciler over one fake machine, with the agent's side recorded."""

    def __init__(self, nvml: NvmlSource, *, partitionable: bool = False) -> None:
        self.nvml = nvml
        self.report = Report()
        self.steps = CountingSteps()
        self.withheld: list[frozenset[int]] = []
        self.claims: dict[int, set[str]] = {}  # prepared here
        self.allocated: dict[int, set[str]] | Exception = {}  # in the API (an exception: it cannot be read)
        self.resets: list[int] = []
        self.reconciler = MigReconciler(
            CONFIGS,
            self.steps,
            NodeHooks(
                discover=nvml.discover,
                withhold=self.withheld.append,
                claims_on=self.claims_on,
                allocated_on=self.allocated_on,
                prepare_lock=nullcontext,
                reset=self.reset,
            ),
            self.report,
            partitionable=partitionable,
            claim_poll_s=0.01,
        )

    def claims_on(self, minors: Collection[int]) -> Mapping[int, Collection[str]]:
        return {m: set(c) for m, c in self.claims.items() if m in minors}

    def allocated_on(self, minors: Collection[int]) -> Mapping[int, Collection[str]]:
        if isinstance(self.allocated, Exception):
            raise self.allocated
        return {m: set(c) for m, c in self.allocated.items() if m in minors}

    def reset(self, gpu: Gpu) -> None:
        self.resets.append(gpu.index)
        self.nvml.fake.reset_gpu(gpu.index)

    def profiles(self) -> Counter[str]:
        return Counter(m.profile for m in self.nvml.discover().mig_devices)


@pytest.fixture
def nvml(request: pytest.FixtureRequest) -> Iterator[NvmlSource]:
    with open_nvml(f"fake:{getattr(request, 'param', 'dgx-h100')}") as source:
        yield source


def test_all_1g10gb_on_dgx_h100_ends_in_success_with_56_devices(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    assert flow.reconciler.reconcile("all-1g.10gb") is MigState.SUCCESS
    assert flow.report.states == ["pending", "success"]
    assert flow.withheld == [frozenset(range(8)), frozenset()]  # withdrawn first, back once applied
    assert flow.profiles() == Counter({"1g.10gb": 56})
    assert flow.report.events[-1][:2] == ("Normal", "MigConfigApplied")
    inventory = nvml.discover()
    assert all(g.mig_enabled for g in inventory.gpus)


def test_a_layout_that_already_matches_costs_no_nvml_change(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    flow.reconciler.reconcile("all-balanced")
    flow.steps.changes.clear()
    again = Flow(nvml)  # e.g. the agent restarted: same label, GPUs already right
    assert again.reconciler.reconcile("all-balanced") is MigState.SUCCESS
    assert again.steps.changes == Counter()
    assert again.report.states == ["success"]
    assert again.withheld == [frozenset()]
    assert "already in place" in again.report.events[-1][2]


def test_balanced_then_disabled_follow(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    assert flow.reconciler.reconcile("all-balanced") is MigState.SUCCESS
    assert flow.profiles() == Counter({"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8})
    assert flow.reconciler.reconcile("all-disabled") is MigState.SUCCESS
    assert flow.profiles() == Counter()
    assert not any(g.mig_enabled or g.mig_pending for g in nvml.discover().gpus)


def test_unknown_name_fails_and_changes_nothing(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    before = nvml.discover()
    assert flow.reconciler.reconcile("all-9g.1tb") is MigState.FAILED
    assert flow.report.states == ["failed"]
    kind, reason, message = flow.report.events[-1]
    assert (kind, reason) == ("Warning", "MigConfigFailed")
    assert message.startswith("unknown MIG config 'all-9g.1tb'")
    assert flow.steps.changes == Counter() and nvml.discover() == before
    assert flow.withheld == [frozenset()]  # nothing withdrawn


def test_a_profile_the_gpu_lacks_fails_naming_it(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    assert flow.reconciler.reconcile("all-1g.5gb") is MigState.FAILED
    assert "profile 1g.5gb on GPU 0 (NVIDIA H100 80GB HBM3)" in flow.report.events[-1][2]
    assert flow.steps.changes == Counter()


def test_an_nvml_error_fails_with_the_step_and_gpu(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    nvml.fake.force_error("nvmlDeviceCreateGpuInstanceWithPlacement", pynvml.NVML_ERROR_UNKNOWN)
    assert flow.reconciler.reconcile("all-7g.80gb") is MigState.FAILED
    message = flow.report.events[-1][2]
    assert "MIG config 'all-7g.80gb' failed on GPU 0" in message and "creating the GPU instance" in message
    assert flow.report.states == ["pending", "failed"]
    assert flow.withheld[-1] == frozenset()  # what the GPUs are now is published again
    # Relabelling (or a restart) continues from there: the error was a one-off.
    assert Flow(nvml).reconciler.reconcile("all-7g.80gb") is MigState.SUCCESS
    assert flow.profiles() == Counter({"7g.80gb": 8})


def test_pending_while_a_claim_holds_a_gpu_then_applied(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    flow.claims = {3: {"default/train-0"}}
    result: list[MigState | None] = []
    worker = threading.Thread(target=lambda: result.append(flow.reconciler.reconcile("all-1g.10gb")))
    worker.start()
    deadline = time.monotonic() + 5
    while not any(r == "MigConfigWaiting" for _, r, _ in flow.report.events) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert flow.report.states == ["pending"]
    waiting = next(m for _, r, m in flow.report.events if r == "MigConfigWaiting")
    assert "default/train-0" in waiting and "GPU minor(s) 3" in waiting
    assert flow.steps.changes == Counter()  # nothing touched under a prepared claim, on any GPU
    assert flow.withheld == [frozenset(range(8))]  # but nothing new lands on them meanwhile
    flow.claims = {}  # unprepared
    worker.join(5)
    assert result == [MigState.SUCCESS]
    assert flow.profiles() == Counter({"1g.10gb": 56})


def _wait_for(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within 5 s"
        time.sleep(0.01)


def test_an_allocated_claim_not_yet_prepared_holds_the_change_until_released(nvml: NvmlSource) -> None:
    """A pod bound, its claim allocated a GPU the label changes, the kubelet not there yet: the change waits
    (pending, the claim named) and touches nothing; once the claim is deallocated it goes on."""
    flow = Flow(nvml)
    flow.allocated = {5: {"team-a/gang-0-gpu"}}
    result: list[MigState | None] = []
    worker = threading.Thread(target=lambda: result.append(flow.reconciler.reconcile("all-1g.10gb")))
    worker.start()
    _wait_for(lambda: any(r == "MigConfigWaiting" for _, r, _ in flow.report.events), "MigConfigWaiting Event")
    time.sleep(0.1)
    assert flow.report.states == ["pending"] and result == []
    waiting = next(m for _, r, m in flow.report.events if r == "MigConfigWaiting")
    assert "team-a/gang-0-gpu" in waiting and "GPU minor(s) 5" in waiting
    assert flow.steps.changes == Counter()
    assert flow.withheld == [frozenset(range(8))]
    flow.allocated = {}  # deallocated
    worker.join(5)
    assert result == [MigState.SUCCESS]


def test_claims_that_cannot_be_read_hold_the_change(nvml: NvmlSource) -> None:
    """The API is away: which claims are allocated cannot be known, so nothing is changed until it can."""
    flow = Flow(nvml)
    flow.allocated = ApiError(503, "the server is currently unable to handle the request")
    result: list[MigState | None] = []
    worker = threading.Thread(target=lambda: result.append(flow.reconciler.reconcile("all-1g.10gb")))
    worker.start()
    _wait_for(lambda: flow.report.states == ["pending"], "pending")
    time.sleep(0.2)
    assert result == [] and flow.steps.changes == Counter()
    flow.allocated = {}
    worker.join(5)
    assert result == [MigState.SUCCESS]


def test_a_new_value_while_pending_replaces_the_old_one(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    flow.claims = {0: {"default/a"}}
    stop = threading.Event()
    worker = threading.Thread(target=flow.reconciler.run, args=(stop,))
    flow.reconciler.offer({CONFIG_LABEL: "all-1g.10gb"})
    worker.start()
    deadline = time.monotonic() + 5
    while flow.report.states != ["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)
    flow.reconciler.offer({CONFIG_LABEL: "all-disabled", "nvidia.com/mig.config.state": "pending"})
    deadline = time.monotonic() + 5
    while flow.report.states[-1:] != ["success"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    flow.reconciler.wake_for_stop()
    worker.join(5)
    assert flow.report.states == ["pending", "success"]  # all-disabled: already so, nothing to wait for
    assert flow.steps.changes == Counter() and flow.profiles() == Counter()


@pytest.mark.parametrize("nvml", ["dgx-a100-40gb"], indirect=True)
def test_ampere_mode_switch_resets_idle_gpus_and_reports_rebooting_for_busy_ones(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    nvml.fake.set_processes(5, [(4242, 1 << 30)])  # someone outside Kubernetes uses GPU 5
    assert flow.reconciler.reconcile("all-1g.5gb") is MigState.REBOOTING
    assert flow.resets == [0, 1, 2, 3, 4, 6, 7]
    assert flow.profiles() == Counter({"1g.5gb": 49})
    kind, reason, message = flow.report.events[-1]
    assert (kind, reason) == ("Warning", "MigConfigRebooting")
    assert "GPU 5 switches MIG mode on only after a reset (the GPU needs a reset), and 1 process(es) use it" in message
    assert flow.withheld[-1] == frozenset({5})  # its mode is pending: not offered until it is done
    gpu5 = nvml.discover().gpus[5]
    assert (gpu5.mig_enabled, gpu5.mig_pending) == (False, True)
    # The process ends and the agent restarts (or the node reboots): the same label finishes the job.
    nvml.fake.set_processes(5, [])
    assert Flow(nvml).reconciler.reconcile("all-1g.5gb") is MigState.SUCCESS
    assert flow.profiles() == Counter({"1g.5gb": 56})


def test_dynamic_mig_takes_the_mode_from_the_label_and_refuses_static_devices(nvml: NvmlSource) -> None:
    flow = Flow(nvml, partitionable=True)
    assert flow.reconciler.reconcile("all-1g.10gb") is MigState.FAILED
    assert "--partitionable-devices" in flow.report.events[-1][2]
    assert flow.steps.changes == Counter()
    assert flow.reconciler.reconcile("all-enabled") is MigState.SUCCESS
    assert all(g.mig_enabled for g in nvml.discover().gpus) and flow.profiles() == Counter()


def test_withheld_at_start_names_the_gpus_still_to_change(nvml: NvmlSource) -> None:
    flow = Flow(nvml)
    inventory = nvml.discover()
    assert flow.reconciler.withheld_at_start(inventory, {CONFIG_LABEL: "all-1g.10gb"}) == frozenset(range(8))
    assert flow.reconciler.withheld_at_start(inventory, {CONFIG_LABEL: "all-disabled"}) == frozenset()
    assert flow.reconciler.withheld_at_start(inventory, {CONFIG_LABEL: "no-such"}) == frozenset()
    assert flow.reconciler.withheld_at_start(inventory, {}) == frozenset()


# --- plans carried out on the fake, which enforces NVML's rules itself ------------------------------


@pytest.mark.parametrize(("nvml", "pairs"), [("gh200", True), ("a100-pcie-x2", False)], indirect=["nvml"])
def test_operator_configs_apply_one_after_another_on_the_fake(nvml: NvmlSource, pairs: bool) -> None:
    """Through NVML, which checks placements itself: on GH200 every applicable config to every other one, on
    two A100s (mode switches by reset) each in turn and back. No step is refused (InsufficientResources
    included), each ends in exactly the wanted layout, and planning again finds nothing to do."""
    steps = MigReconfiguration()
    names = []
    for name in CONFIGS.names():
        try:
            wanted = wanted_layouts(CONFIGS, name, nvml.discover())
            plan_node(nvml.discover(), wanted)
        except (ConfigRefused, LayoutDoesNotFit):
            continue  # a config for other products
        if len(wanted) == len(nvml.fake.gpus):
            names.append(name)
    assert len(names) >= 9
    walk = [names[0]]
    for a, b in itertools.permutations(names, 2) if pairs else itertools.pairwise([*names, names[0]]):
        walk += [a, b] if walk[-1] != a else [b]
    for name in walk:
        inventory = nvml.discover()
        wanted = wanted_layouts(CONFIGS, name, inventory)
        for plan in plan_node(inventory, wanted):
            gpu = inventory.gpu(plan.minor)
            assert gpu is not None
            apply_plan(plan, gpu, steps, lambda g: nvml.fake.reset_gpu(g.index))
        after = nvml.discover()
        for gpu in after.gpus:
            want = wanted[gpu.minor]
            assert gpu.mig_enabled == want.mig_enabled, name
            got = Counter(m.profile for m in after.mig_devices_of(gpu.minor))
            assert got == Counter(dict(want.devices)), name
        assert not any(p.changes for p in plan_node(after, wanted)), name


def test_a_state_label_that_cannot_be_written_is_written_on_the_next_try(nvml: NvmlSource) -> None:
    """The API server refuses the `success` label once: the loop tries the value again and, the GPUs being
    done by then, only writes the label."""
    flow = Flow(nvml)
    failures = iter([True])
    original = flow.report.set_labels

    def flaky(labels: dict[str, str | None]) -> None:
        if labels.get("nvidia.com/mig.config.state") == "success" and next(failures, False):
            raise ConnectionError("API server unreachable")
        original(labels)

    flow.report.set_labels = flaky  # type: ignore[method-assign]
    flow.reconciler._retry_s = 0.05
    stop = threading.Event()
    worker = threading.Thread(target=flow.reconciler.run, args=(stop,))
    flow.reconciler.offer({CONFIG_LABEL: "all-7g.80gb"})
    worker.start()
    deadline = time.monotonic() + 10
    while flow.report.states[-1:] != ["success"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    flow.reconciler.wake_for_stop()
    worker.join(5)
    assert flow.report.states == ["pending", "success"]
    assert flow.steps.changes == Counter({"mode": 8, "create": 8})  # the second try changed nothing


@pytest.mark.parametrize("nvml", ["dgx-a100-40gb"], indirect=True)
def test_a_gpu_waiting_for_its_reset_is_reset_once_its_processes_are_gone(nvml: NvmlSource) -> None:
    """`rebooting` is retried: when the process on GPU 2 ends, the agent resets it and reports `success`,
    without going back to `pending` or repeating its Event meanwhile."""
    flow = Flow(nvml)
    flow.reconciler._retry_s = 0.05
    nvml.fake.set_processes(2, [(4242, 1 << 30)])
    stop = threading.Event()
    worker = threading.Thread(target=flow.reconciler.run, args=(stop,))
    flow.reconciler.offer({CONFIG_LABEL: "all-7g.40gb"})
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while flow.report.states[-1:] != ["rebooting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # several retries while the process runs
        assert flow.report.states == ["pending", "rebooting"]
        assert [r for _, r, _ in flow.report.events].count("MigConfigRebooting") == 1
        nvml.fake.set_processes(2, [])
        while flow.report.states[-1:] != ["success"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        flow.reconciler.wake_for_stop()
        worker.join(5)
    assert flow.report.states == ["pending", "rebooting", "success"]
    assert sorted(flow.resets) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert flow.profiles() == Counter({"7g.40gb": 8})
