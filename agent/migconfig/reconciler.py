"""The label flow: `nvidia.com/mig.config=<name>` on the own Node becomes the GPUs' MIG layout.

For a new value: plan every GPU the config covers (refused configs end in `failed` at once, nothing
touched); a layout that already matches ends in `success` with no NVML call that changes anything.
Otherwise the state label goes `pending`, the GPUs that change are withdrawn from the ResourceSlices and
from the arbiter's reservations (and prepare refuses their devices), and the flow waits while any device of
them is held: by a claim prepared here, by a claim allocated in the API but not prepared yet (its pod is
bound and about to start), or by a reservation (an Event names them); claims it cannot read count as held.
Then, under the node's prepare lock, it plans again from a fresh discovery, applies, puts the
GPUs back into the slices and sets `success`; `failed` with an Event on an NVML error; `rebooting` when a
MIG mode switch waits for a reset that processes on the GPU prevent.

Crash-safe by construction: nothing is remembered between runs but the label. A restarted agent plans
from what the GPUs are now, withholds the GPUs that still change before its first publish (`withheld_at_start`)
and continues.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from agent.devices.model import Gpu, Inventory
from agent.migconfig.applying import MigSteps, NeedsReboot, apply_plan
from agent.migconfig.desired import ConfigRefused, wanted_layouts
from agent.migconfig.plan import GpuPlan, LayoutDoesNotFit, plan_node
from agent.migconfig.spec import MigConfigs

log = logging.getLogger(__name__)

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"


class MigState(enum.StrEnum):
    PENDING = "pending"
    SUCCESS = "success"
    FAILED = "failed"
    REBOOTING = "rebooting"


class NodeReport(Protocol):
    """Where the flow reports (agent.kube.node_status.NodeStatus)."""

    def set_labels(self, labels: dict[str, str | None]) -> None: ...
    def event(self, event_type: str, reason: str, message: str) -> None: ...


@dataclass(frozen=True)
class NodeHooks:
    """What the flow needs from the node agent."""

    discover: Callable[[], Inventory]  # a fresh discovery, also kept as the agent's inventory
    withhold: Callable[[frozenset[int]], None]  # keep these GPUs (minors) out of the slices; publish now
    # What holds a device of these GPUs, by GPU minor: here (prepared claims, reservations; checked again
    # under the prepare lock) and in the API (allocated claims; read outside the lock, which guards local
    # state, not the network). Either raises when that cannot be known: the flow keeps waiting then.
    claims_on: Callable[[Collection[int]], Mapping[int, Collection[str]]]
    allocated_on: Callable[[Collection[int]], Mapping[int, Collection[str]]]
    prepare_lock: Callable[[], AbstractContextManager[object]]  # no prepare or unprepare runs meanwhile
    reset: Callable[[Gpu], None]  # reset one GPU (nvidia-smi -r), raises on failure


class MigReconciler:
    """Follows the label from its own thread (`run`); `offer` hands it the Node's labels from the watch."""

    def __init__(
        self,
        configs: MigConfigs,
        steps: MigSteps,
        hooks: NodeHooks,
        report: NodeReport,
        *,
        partitionable: bool = False,
        claim_poll_s: float = 1.0,
        retry_s: float = 5.0,
    ) -> None:
        self._configs = configs
        self._steps = steps
        self._hooks = hooks
        self._report = report
        self._partitionable = partitionable
        self._claim_poll_s = claim_poll_s
        self._retry_s = retry_s
        self._wake = threading.Condition()
        self._wanted: str | None = None  # the label's value, as last offered
        self._offered = False
        self._done: str | None = None  # the value last carried to an end state
        self._state: str | None = None  # the state label as last seen or written
        self._last_event: tuple[str, str] | None = None
        self._rebooting: str | None = None  # the value whose GPUs wait for a reset

    # --- inputs -------------------------------------------------------------------------------------

    def offer(self, labels: Mapping[str, str]) -> None:
        """The Node's labels (from the watch, or read once at start)."""
        with self._wake:
            self._state = labels.get(STATE_LABEL)
            value = labels.get(CONFIG_LABEL)
            if self._offered and value == self._wanted:
                return
            self._wanted, self._offered = value, True
            self._wake.notify_all()

    def withheld_at_start(self, inventory: Inventory, labels: Mapping[str, str]) -> frozenset[int]:
        """GPUs the label still changes, to keep out of the agent's first publish (e.g. after a crash in
        the middle of an apply). A config that cannot be planned withholds nothing: it changes nothing."""
        value = labels.get(CONFIG_LABEL)
        if value is None:
            return frozenset()
        try:
            return frozenset(p.minor for p in self._plans(value, inventory) if p.changes)
        except (ConfigRefused, LayoutDoesNotFit):
            return frozenset()

    # --- the loop -----------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        """Reconcile each new value until `stop` is set (the caller also calls `wake_for_stop`). A value whose
        end state could not be written (API trouble) is tried again after `retry_s`."""
        while not stop.is_set():
            with self._wake:
                while not stop.is_set() and (not self._offered or self._wanted == self._done):
                    self._wake.wait()
                value = self._wanted
            if stop.is_set():
                return
            try:
                self.reconcile(value, stop)
            except Exception:  # the thread must survive: the next label change or restart tries again
                log.exception("MIG reconfiguration for %r failed unexpectedly", value)
                self._end(
                    value,
                    MigState.FAILED,
                    "MigConfigFailed",
                    f"MIG config {value!r} failed: unexpected error, see the agent's log",
                )
            with self._wake:
                if self._done != value and self._wanted == value and not stop.is_set():
                    self._wake.wait(self._retry_s)  # a new value or stop wakes it early

    def wake_for_stop(self) -> None:
        with self._wake:
            self._wake.notify_all()

    def reconcile(self, value: str | None, stop: threading.Event | None = None) -> MigState | None:
        """Carry `value` to an end state (None: no label, nothing asked). Returns the state set, or None
        when a newer value or `stop` interrupted the wait for claims."""
        stop = stop or threading.Event()
        if value is None:
            self._done = None
            return None
        try:
            plans = self._plans(value, self._hooks.discover())
        except (ConfigRefused, LayoutDoesNotFit) as exc:
            self._hooks.withhold(frozenset())  # whatever an earlier value withdrew is offered again, unchanged
            return self._end(value, MigState.FAILED, "MigConfigFailed", str(exc))
        changing = frozenset(p.minor for p in plans if p.changes)
        if not changing:
            self._hooks.withhold(frozenset())
            return self._end(
                value, MigState.SUCCESS, "MigConfigApplied", f"MIG config {value!r} already in place: nothing to change"
            )
        if (self._state, self._rebooting) != (MigState.REBOOTING, value):  # a retry stays `rebooting` till done
            self._set_state(MigState.PENDING)
            gpus = ", ".join(str(p.index) for p in plans if p.changes)
            self._event("Normal", "MigConfigPending", f"MIG config {value!r}: reconfiguring GPU(s) {gpus}")
        self._hooks.withhold(changing)
        while True:
            if not self._wait_for_claims(value, changing, stop):
                return None
            try:
                with self._hooks.prepare_lock():
                    if self._claims(changing, api=False) != {}:
                        continue  # a prepare won the race for the lock (None: unknown)
                    return self._apply(value)
            except TimeoutError:  # prepares kept the lock busy: wait again, the claims may have changed
                log.info("the prepare lock was busy; MIG config %r waits", value)

    # --- internals ----------------------------------------------------------------------------------

    def _plans(self, value: str, inventory: Inventory) -> tuple[GpuPlan, ...]:
        wanted = wanted_layouts(self._configs, value, inventory, partitionable=self._partitionable)
        return plan_node(inventory, wanted)

    def _claims(self, minors: Collection[int], *, api: bool = True) -> dict[int, list[str]] | None:
        """What holds the GPUs, by minor (with `api`, claims allocated in the API too); None when it cannot be
        known now."""
        try:
            held: dict[int, set[str]] = {}
            for found in (self._hooks.claims_on(minors), self._hooks.allocated_on(minors) if api else {}):
                for minor, holders in found.items():
                    held.setdefault(minor, set()).update(holders)
            return {m: sorted(c) for m, c in held.items() if c}
        except Exception as exc:  # e.g. the API server is away: nothing may be taken from a claim we cannot see
            log.warning("cannot tell which claims hold the GPUs a MIG change waits for: %s", exc)
            return None

    def _superseded(self, value: str) -> bool:
        with self._wake:
            return self._offered and self._wanted != value

    def _wait_for_claims(self, value: str, minors: frozenset[int], stop: threading.Event) -> bool:
        """Until nothing holds a device of the GPUs (no claim prepared or allocated on them, no reservation);
        False when a newer value or stop came first."""
        told: dict[int, list[str]] | None = None
        while True:
            if stop.is_set() or self._superseded(value):
                return False
            held = self._claims(minors)
            if held == {}:
                return True
            if held is not None and held != told:
                names = sorted({c for cs in held.values() for c in cs})
                self._event(
                    "Warning",
                    "MigConfigWaiting",
                    f"MIG config {value!r} waits for claim(s) {', '.join(names)} on GPU minor(s) "
                    f"{', '.join(str(m) for m in sorted(held))} to be released (unprepared and deallocated)",
                )
                told = held
            with self._wake:
                self._wake.wait(self._claim_poll_s)

    def _apply(self, value: str) -> MigState:
        """Plan again from what the GPUs are now (claims may have changed them while we waited), apply."""
        inventory = self._hooks.discover()
        try:
            plans = [p for p in self._plans(value, inventory) if p.changes]
        except (ConfigRefused, LayoutDoesNotFit) as exc:
            self._hooks.withhold(frozenset())
            return self._end(value, MigState.FAILED, "MigConfigFailed", str(exc))
        waiting: list[str] = []
        failure: str | None = None
        for plan in plans:
            gpu = inventory.gpu(plan.minor)
            assert gpu is not None  # plans are made from this inventory's GPUs
            try:
                apply_plan(plan, gpu, self._steps, self._hooks.reset)
            except NeedsReboot as exc:
                waiting.append(str(exc))
            except Exception as exc:  # an NVML error, a failed reset: stop here, say which step failed
                log.exception("applying MIG config %r failed", value)
                failure = f"MIG config {value!r} failed on GPU {plan.index}: {exc}"
                break
        inventory = self._hooks.discover()
        still = frozenset(p.minor for p in self._plans(value, inventory) if p.changes) if waiting else frozenset()
        self._hooks.withhold(still)  # publish what the GPUs are now
        if failure is not None:
            return self._end(value, MigState.FAILED, "MigConfigFailed", failure)
        if waiting:
            return self._end(
                value,
                MigState.REBOOTING,
                "MigConfigRebooting",
                f"MIG config {value!r} needs a reset or reboot: " + "; ".join(waiting),
            )
        gpus = ", ".join(str(p.index) for p in plans)
        return self._end(value, MigState.SUCCESS, "MigConfigApplied", f"MIG config {value!r} applied to GPU(s) {gpus}")

    def _end(self, value: str | None, state: MigState, reason: str, message: str) -> MigState:
        self._event("Normal" if state is MigState.SUCCESS else "Warning", reason, message)
        log.info("MIG config %s: %s", state, message)
        # Not done when the label could not be written (`run` writes it on the next try), nor while a GPU
        # waits for its reset: `run` tries again, and a GPU whose processes have gone is reset then.
        self._rebooting = value if state is MigState.REBOOTING else None
        if self._set_state(state) and state is not MigState.REBOOTING:
            self._done = value
        return state

    def _event(self, event_type: str, reason: str, message: str) -> None:
        """An Event, unless it repeats the last one word for word (retries of a `rebooting` value)."""
        if (reason, message) == self._last_event:
            return
        self._report.event(event_type, reason, message)
        self._last_event = (reason, message)

    def _set_state(self, state: MigState) -> bool:
        """Write the state label unless it already says so; False when the write failed."""
        if self._state == state:
            return True
        try:
            self._report.set_labels({STATE_LABEL: str(state)})
        except Exception as exc:  # an API error of any kind: reported, retried by `run`
            log.warning("setting %s=%s failed: %s", STATE_LABEL, state, exc)
            return False
        self._state = state
        return True
