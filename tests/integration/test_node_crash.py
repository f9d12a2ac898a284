"""kill -9 the daemon at random moments of a prepare/unprepare loop driven by the kubelet fake; restart it
with the same state dir and check that the node converges, as a kubelet retrying its calls would see it.

The test plays the kubelet: it remembers which claims it saw prepared (and their CDI ids), and after each
restart it first retries the call the kill interrupted. Then the daemon is idle and must show: every
checkpointed claim completed and exactly the claims the kubelet holds (no lost prepared claim, no stale
one), a CDI spec for each of them and no other file (no leaked spec, no temp file), and a re-prepare of
every held claim returning the same CDI ids (idempotent).
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable, Sequence

import pytest

import fakes.apiserver
from agent.claims import cdi
from agent.claims.checkpoint import CheckpointStore, ClaimState
from agent.claims.types import ClaimRef
from fakes.kubelet import FakeKubelet, KubeletError, Retry
from tests.integration.test_node_support import (
    DRIVER,
    Daemon,
    allocate_claim,
    cdi_id,
    create_node,
    running,
    short_tmpdir,
)

KILLS = 12
MAX_KILL_DELAY_S = 0.3  # after the plugin serves: tens of prepare/unprepare calls, then the kill lands
CLEAN_RECOVERY = "Recovery(rolled_back=(), restored_specs=(), removed_specs=(), removed_temps=0)"
# Six 1-GPU claims and one 2-GPU claim, on distinct GPUs, so no prepare is refused for a device conflict.
DEVICES = [["gpu-0"], ["gpu-1"], ["gpu-2"], ["gpu-3"], ["gpu-4"], ["gpu-5"], ["gpu-6", "gpu-7"]]


Retried = Callable[[], None]


class Kubelet:
    """The kubelet's side of the story: calls that must succeed, and what it believes is prepared."""

    def __init__(self, fake: FakeKubelet, devices: dict[str, list[str]], seed: int) -> None:
        self.fake = fake
        self.devices = devices  # claim uid -> allocated devices
        self.prepared: dict[str, tuple[tuple[str, ...], ...]] = {}  # uid -> CDI ids per device
        self.seed = seed

    def prepare(self, refs: Sequence[ClaimRef]) -> None:
        results = self.fake.prepare(DRIVER, refs)
        for ref in refs:
            result = results[ref.uid]
            assert result.error == "", f"seed {self.seed}: prepare {ref.name}: {result.error}"
            ids = tuple(d.cdi_device_ids for d in result.devices)
            assert ids == tuple((cdi_id(ref, d),) for d in self.devices[ref.uid]), f"seed {self.seed}: {ref.name}"
            if ref.uid in self.prepared:  # a retry or a repeat: the stored result, unchanged
                assert ids == self.prepared[ref.uid], f"seed {self.seed}: {ref.name} changed its CDI ids"
            self.prepared[ref.uid] = ids

    def unprepare(self, refs: Sequence[ClaimRef]) -> None:
        errors = self.fake.unprepare(DRIVER, refs)
        assert set(errors.values()) == {""}, f"seed {self.seed}: unprepare: {errors}"
        for ref in refs:
            self.prepared.pop(ref.uid, None)


def retry_until_served(call: Retried, timeout: float = 20.0) -> None:
    """Retry a call the kill interrupted until the restarted agent answers (as the kubelet does)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call()
            return
        except KubeletError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def assert_converged(daemon: Daemon, kubelet: Kubelet, refs: Sequence[ClaimRef]) -> None:
    seed = kubelet.seed
    checkpoint = CheckpointStore(daemon.state_dir, lambda: "unused").load()
    states = {uid: e.state for uid, e in checkpoint.claims.items()}
    assert states == dict.fromkeys(kubelet.prepared, ClaimState.COMPLETED), f"seed {seed}: checkpoint {states}"
    for uid, entry in checkpoint.claims.items():
        assert tuple(d.cdi_device_ids for d in entry.devices) == kubelet.prepared[uid], f"seed {seed}: {uid}"
    files = sorted(p.name for p in daemon.cdi_root.iterdir()) if daemon.cdi_root.exists() else []
    assert files == sorted(cdi.spec_file_name(uid) for uid in kubelet.prepared), f"seed {seed}: CDI root {files}"
    held = [r for r in refs if r.uid in kubelet.prepared]
    if held:
        kubelet.prepare(held)  # asserts the same CDI ids come back


def recovered(daemon: Daemon) -> bool:
    """Whether the restarted agent found something to repair (a started claim, a stray spec or temp file)."""
    return bool(daemon.wait_for_log("claim checkpoint ready")["recovery"] != CLEAN_RECOVERY)


def drive_until_killed(
    daemon: Daemon, kubelet: Kubelet, refs: Sequence[ClaimRef], rng: random.Random
) -> tuple[int, Retried]:
    """Prepare and unprepare random batches (a pod's claims) until a kill at a random moment cuts a call short.

    Returns how many calls were answered, and the interrupted call for the kubelet to retry."""
    killing = threading.Event()

    def kill() -> None:
        killing.set()
        daemon.kill()

    killer = threading.Timer(rng.uniform(0, MAX_KILL_DELAY_S), kill)
    killer.start()
    answered = 0
    try:
        while True:
            batch = rng.sample(list(refs), rng.randint(1, 3))
            op = kubelet.prepare if rng.random() < 0.55 else kubelet.unprepare
            try:
                op(batch)
            except KubeletError:
                if not killing.is_set():
                    raise  # a failure of the agent itself, not of the kill
                return answered, functools.partial(op, batch)
            answered += 1
    finally:
        killer.join()
        assert daemon.proc is not None and daemon.proc.returncode == -9, f"seed {kubelet.seed}: {daemon.tail()}"


@pytest.mark.timeout(300)  # a dozen agent restarts: over 120 s on a loaded machine
def test_kill_9_during_prepare_unprepare_converges_after_restart() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    began = time.monotonic()
    repaired = calls = 0
    with short_tmpdir("crash-") as root, fakes.apiserver.start(port=0) as server:
        api = server.api_client()
        create_node(api)
        refs = [allocate_claim(api, f"claim-{i}", devices) for i, devices in enumerate(DEVICES)]
        daemon = Daemon(root, server.write_kubeconfig(root / "kubeconfig"))
        # one attempt per call: a dead agent shows at once; the retries after restart are ours
        with FakeKubelet(daemon.kubelet_root, retry=Retry(attempts=1), timeout=10) as fake:
            kubelet = Kubelet(fake, {r.uid: DEVICES[i] for i, r in enumerate(refs)}, seed)
            interrupted: Retried | None = None
            for _ in range(KILLS):
                with running(daemon):
                    repaired += recovered(daemon)
                    fake.wait_for_driver(DRIVER)
                    if interrupted is not None:
                        retry_until_served(interrupted)
                    assert_converged(daemon, kubelet, refs)
                    answered, interrupted = drive_until_killed(daemon, kubelet, refs, rng)
                    calls += answered

            with running(daemon):  # the last restart ends the story: unprepare all, nothing left behind
                repaired += recovered(daemon)
                assert interrupted is not None
                retry_until_served(interrupted)
                assert_converged(daemon, kubelet, refs)
                kubelet.unprepare(refs)
                assert_converged(daemon, kubelet, refs)
                assert daemon.terminate() == 0
    print(
        f"\n{KILLS} kills (seed {seed}): {calls} calls answered, {repaired} restarts repaired state, "
        f"{time.monotonic() - began:.1f}s"
    )
