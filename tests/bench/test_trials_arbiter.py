"""Opt-in trials (marker `trials`, `make trials`): the arbiter killed with SIGKILL in the middle of its commits,
and two arbiters started at once with leader election. Numbers are printed; every count of damage must be 0.

    TRIALS=200 make trials       # the issue's 200 kill -9 trials (default 20); LEADER_TRIALS (default 5)

1. kill -9 during commits: a burst of gangs (3 gangs of 2 pods x 2 GPUs, 4 pods of 1 GPU: all 16 GPUs of two
   nodes) and the arbiter killed as soon as its commits reach a phase, taken in turn: devices reserved on a
   node, claim allocations written, pods ungated. A new arbiter then finishes or undoes what was half done.
   Counted after recovery: gangs partly admitted, claims allocated twice (reserved for more than one pod or
   holding more devices than they ask for), devices in two claims or reserved on a node for another holder.
2. two arbiters with --leader-elect started together: writes per process (by bearer token, Lease writes
   aside), then the leader killed with SIGKILL while it commits a burst; the standby's takeover time against
   the Lease duration, and the same damage counts once it has finished.
3. the leader paused (SIGSTOP) while it commits a burst, for longer than the Lease (SIGSTOP_TRIALS, default 3;
   the default Lease timings and a 20 s pause, as the issue's probe): the standby takes the Lease, then the old
   leader resumes (SIGCONT). Counted: the old leader's writes after the takeover (claims, pods, Events, the
   Lease), which must be 0, and the same damage counts once the new leader has finished.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml

from agent.kube.errors import NotFound
from agent.kube.leader import LeaderElector
from agent.kube.rest import LEASES, POD_GROUPS, PODS, RESOURCE_CLAIMS
from agent.objects.read import is_gated
from fakes.apiserver import server as fake_server
from fakes.cluster import FakeCluster, wait_for

pytestmark = pytest.mark.trials
PHASES = ("reserve", "claims", "ungate")
GANGS = 3  # of 2 pods x 2 GPUs
SINGLES = 4  # pods of 1 GPU
PODS_PER_BURST = GANGS * 2 + SINGLES
# reservations a killed arbiter made and never confirmed hold their devices until they expire: recovery takes
# about this long when the kill lands between reserve and confirm (30 s by default; shorter keeps trials short)
TTL_S = float(os.environ.get("TRIAL_RESERVATION_TTL", "5"))


def _burst(cluster: FakeCluster, ns: str) -> None:
    for i in range(GANGS):
        cluster.gang(ns, f"g{i}", "team-a", pods=2, gpus=2)
    for i in range(SINGLES):
        cluster.gang(ns, f"s{i}", "team-a", pods=1, gpus=1)


def _claims(cluster: FakeCluster, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.rest.list(RESOURCE_CLAIMS, ns)["items"]
    return items


def _results(claim: dict[str, Any]) -> list[dict[str, Any]]:
    return list((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or ())


def _live(cluster: FakeCluster) -> int:
    return sum(len(a.book.live()) for a in cluster.agents.values())


def _phase_reached(cluster: FakeCluster, ns: str, phase: str) -> bool:
    if phase == "reserve":
        return _live(cluster) > 0
    if phase == "claims":
        return any(_results(c) for c in _claims(cluster, ns))
    return any(not is_gated(p) for p in cluster.pods(ns))


def _state(cluster: FakeCluster, ns: str) -> dict[str, int]:
    pods = cluster.pods(ns)
    return {
        "reservations": _live(cluster),
        "claims allocated": sum(1 for c in _claims(cluster, ns) if _results(c)),
        "pods ungated": sum(1 for p in pods if not is_gated(p)),
    }


def _damage(cluster: FakeCluster, ns: str) -> dict[str, int]:
    """What must be 0 once the arbiter has recovered."""
    pods = {p["metadata"]["name"]: p for p in cluster.pods(ns)}
    by_gang: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for p in pods.values():
        by_gang[(p["spec"].get("schedulingGroup") or {}).get("podGroupName") or p["metadata"]["name"]].append(p)
    partial = sum(1 for members in by_gang.values() if 0 < sum(not is_gated(p) for p in members) < len(members))
    twice = 0
    holders: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    for c in cluster.rest.list(RESOURCE_CLAIMS)["items"]:
        results = _results(c)
        asked = sum(int((r.get("exactly") or {}).get("count") or 1) for r in c["spec"]["devices"]["requests"])
        reserved = (c.get("status") or {}).get("reservedFor") or ()
        if results and (len(results) > asked or len(reserved) > 1):
            twice += 1
        for r in results:
            holders[(r["pool"], r["device"])].append(c["metadata"]["uid"])
    in_two = sum(1 for uids in holders.values() if len(uids) > 1)
    for node, agent in cluster.agents.items():  # a node still reserving a device a claim holds for someone else
        for reservation in agent.book.live():
            for device in reservation.fit.all_devices:
                if (node, device) in holders:
                    in_two += 1
    return {"gangs partly admitted": partial, "claims allocated twice": twice, "devices held by two claims": in_two}


def _cleanup(cluster: FakeCluster, ns: str) -> None:
    for p in cluster.pods(ns):
        cluster.rest.delete(PODS, ns, p["metadata"]["name"])
    for g in cluster.rest.list(POD_GROUPS, ns)["items"]:
        cluster.rest.delete(POD_GROUPS, ns, g["metadata"]["name"])
    wait_for(
        lambda: not any(_results(c) for c in cluster.rest.list(RESOURCE_CLAIMS)["items"]) and _live(cluster) == 0,
        timeout=90,
        what="devices freed for the next trial",
    )


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(nodes=2) as c:
        c.queue("root")
        c.queue("team-a", parent="root", gpu_quota=16)
        yield c


def _arbiter(cluster: FakeCluster, kubeconfig: Any = None, *extra: str) -> subprocess.Popen[bytes]:
    return cluster.arbiter_process("--period", "0.1", "--reservation-ttl", str(TTL_S), *extra, kubeconfig=kubeconfig)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _kill_at(
    cluster: FakeCluster, ns: str, proc: subprocess.Popen[bytes], phase: str, rng: random.Random
) -> dict[str, int] | None:
    """SIGKILL `proc` as soon as the burst's commits reach `phase` (a few ms later, at random); the state then,
    or None when the arbiter had already admitted everything (the kill came too late)."""
    deadline = time.monotonic() + 60
    while not _phase_reached(cluster, ns, phase):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the arbiter never reached {phase}")
        time.sleep(0.002)
    time.sleep(rng.uniform(0, 0.02))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    state = _state(cluster, ns)
    done = state["pods ungated"] == PODS_PER_BURST and state["reservations"] == 0
    return None if done else state


def _recovered(cluster: FakeCluster, ns: str) -> bool:
    pods = cluster.pods(ns)
    return (
        len(pods) == PODS_PER_BURST
        and all(not is_gated(p) and p["spec"].get("nodeName") for p in pods)
        and _live(cluster) == 0
    )


def test_kill_minus_nine_during_commits(cluster: FakeCluster) -> None:
    trials = int(os.environ.get("TRIALS", "20"))
    rng = random.Random(17)
    damage: collections.Counter[str] = collections.Counter()
    hit: collections.Counter[str] = collections.Counter()
    half_done: collections.Counter[str] = collections.Counter()
    recovery: list[float] = []
    started = time.monotonic()
    for trial in range(trials):
        ns = f"trial-{trial}"
        phase = PHASES[trial % len(PHASES)]
        _burst(cluster, ns)
        first = _arbiter(cluster)
        try:
            state = _kill_at(cluster, ns, first, phase, rng)
        finally:
            _stop(first)
        if state is not None:
            hit[phase] += 1
            gangs_written = state["claims allocated"]
            half_done["claims written, pods still gated"] += bool(gangs_written and state["pods ungated"] == 0)
            half_done["reservations held"] += bool(state["reservations"])
        killed = time.monotonic()
        second = _arbiter(cluster)
        try:
            wait_for(lambda ns=ns: _recovered(cluster, ns), timeout=120, what=f"trial {trial} recovered")
            recovery.append(time.monotonic() - killed)
        finally:
            _stop(second)
        damage.update(_damage(cluster, ns))
        _cleanup(cluster, ns)
    print(
        f"\nkill -9 trials: {trials} in {time.monotonic() - started:.0f} s (reservation TTL {TTL_S:g} s); killed "
        f"mid-commit per phase "
        f"{dict(hit)} (the rest after the burst was admitted); at the kill: {dict(half_done)}"
    )
    median = sorted(recovery)[len(recovery) // 2]
    print(f"recovery (restart to all {PODS_PER_BURST} pods admitted): median {median:.1f} s, max {max(recovery):.1f} s")
    print(
        "after recovery: "
        + ", ".join(
            f"{k} {damage[k]}"
            for k in ("gangs partly admitted", "claims allocated twice", "devices held by two claims")
        )
    )
    assert sum(damage.values()) == 0, damage


# -- two arbiters, one Lease ------------------------------------------------------------------------------


class _Writes:
    """Writes the API fake serves, by bearer token (one per arbiter process); Lease writes kept apart. `log`:
    each write's (monotonic time it arrived, token, whether it is a Lease write, method and path)."""

    def __init__(self) -> None:
        self.by_token: collections.Counter[tuple[str, bool]] = collections.Counter()
        self.log: list[tuple[float, str, bool, str]] = []
        self._original: Callable[..., Any] = fake_server._Handler._serve

    def __enter__(self) -> _Writes:
        original, counts, log = self._original, self.by_token, self.log

        def serve(handler: Any, method: str) -> Any:
            if method in ("POST", "PUT", "PATCH", "DELETE"):
                token = (handler.headers.get("Authorization") or "").removeprefix("Bearer ")
                counts[(token, "/leases" in handler.path)] += 1
                log.append((time.monotonic(), token, "/leases" in handler.path, f"{method} {handler.path}"))
            return original(handler, method)

        fake_server._Handler._serve = serve  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        fake_server._Handler._serve = self._original  # type: ignore[method-assign]


def _holder(cluster: FakeCluster) -> str:
    try:
        return str(cluster.rest.get(LEASES, "default", "gpu-dra-arbiter")["spec"].get("holderIdentity") or "")
    except NotFound:
        return ""


def _kubeconfig(cluster: FakeCluster, token: str) -> Any:
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    for user in config["users"]:
        user["user"]["token"] = token
    path = cluster.root / f"kubeconfig-{token}"
    path.write_text(yaml.safe_dump(config))
    return path


def test_two_arbiters_only_the_lease_holder_writes_and_the_standby_takes_over(cluster: FakeCluster) -> None:
    trials = int(os.environ.get("LEADER_TRIALS", "5"))
    lease_s = LeaderElector.__init__.__kwdefaults__["lease_duration"]
    retry_s = LeaderElector.__init__.__kwdefaults__["retry_period"]
    rng = random.Random(23)
    damage: collections.Counter[str] = collections.Counter()
    standby_writes: list[int] = []
    leader_writes: list[int] = []
    takeovers: list[float] = []
    for trial in range(trials):
        ns = f"lead-{trial}"
        tokens = (f"arbiter-{trial}-a", f"arbiter-{trial}-b")
        with _Writes() as writes:
            procs = {
                t: _arbiter(cluster, _kubeconfig(cluster, t), "--leader-elect", "--leader-elect-namespace", "default")
                for t in tokens
            }
            try:
                _burst(cluster, ns)
                holder = wait_for(lambda: _holder(cluster), timeout=60, what="a leader")
                leader = next(t for t, p in procs.items() if f"_{p.pid}_" in holder)
                standby = next(t for t in tokens if t != leader)
                state = _kill_at(cluster, ns, procs[leader], PHASES[trial % len(PHASES)], rng)
                killed = time.monotonic()
                # until the kill, only the leader wrote anything but the Lease
                standby_writes.append(writes.by_token[(standby, False)])
                leader_writes.append(writes.by_token[(leader, False)])
                wait_for(
                    lambda holder=holder: _holder(cluster) not in ("", holder),
                    timeout=lease_s * 3,
                    interval=0.1,
                    what="a new leader",
                )
                takeovers.append(time.monotonic() - killed)
                wait_for(lambda ns=ns: _recovered(cluster, ns), timeout=120, what=f"leader trial {trial} recovered")
                assert state is None or writes.by_token[(standby, False)] > 0  # the standby finished the work
            finally:
                for p in procs.values():
                    _stop(p)
        damage.update(_damage(cluster, ns))
        _cleanup(cluster, ns)
    print(
        f"\ntwo arbiters, {trials} trials: writes other than the Lease before the leader's kill -9: leader "
        f"{sum(leader_writes)} (per trial {leader_writes}), standby {sum(standby_writes)}"
    )
    print(
        f"takeover after kill -9 of the leader: median {sorted(takeovers)[len(takeovers) // 2]:.1f} s, max "
        f"{max(takeovers):.1f} s (Lease duration {lease_s:g} s, standby retries every {retry_s:g} s)"
    )
    print(
        "after the takeover: "
        + ", ".join(
            f"{k} {damage[k]}"
            for k in ("gangs partly admitted", "claims allocated twice", "devices held by two claims")
        )
    )
    assert sum(standby_writes) == 0
    assert max(takeovers) <= lease_s + retry_s
    assert sum(damage.values()) == 0, damage


# -- a paused leader --------------------------------------------------------------------------------------


def paused_leader_trial(
    cluster: FakeCluster, ns: str, *, lease_s: float, renew_s: float, retry_s: float, pause_s: float
) -> dict[str, Any]:
    """Two arbiters with these Lease timings; the leader stopped (SIGSTOP) as soon as its commits of a burst
    reserve devices, for `pause_s` or until the standby has taken the Lease if later, then resumed (SIGCONT).
    Returns the old leader's writes after the takeover ("writes after takeover": what it sent, method and
    path), how it ended ("exit code": 1 when it saw it had lost the Lease), the takeover time since the pause,
    and the damage once the new leader has finished."""
    tokens = (f"{ns}-a", f"{ns}-b")
    timings = (
        "--leader-elect-lease-duration",
        str(lease_s),
        "--leader-elect-renew-deadline",
        str(renew_s),
        "--leader-elect-retry-period",
        str(retry_s),
    )
    with _Writes() as writes:
        procs = {
            t: _arbiter(
                cluster, _kubeconfig(cluster, t), "--leader-elect", "--leader-elect-namespace", "default", *timings
            )
            for t in tokens
        }
        try:
            holder = wait_for(lambda: _holder(cluster), timeout=60, what="a leader")
            leader = next(t for t, p in procs.items() if f"_{p.pid}_" in holder)
            _burst(cluster, ns)
            wait_for(
                lambda: _phase_reached(cluster, ns, "reserve"), timeout=60, interval=0.002, what="the leader's commits"
            )
            os.kill(procs[leader].pid, signal.SIGSTOP)
            paused = time.monotonic()
            wait_for(
                lambda: _holder(cluster) not in ("", holder),
                timeout=lease_s * 3 + pause_s,
                interval=0.05,
                what="the standby takes the Lease",
            )
            taken = time.monotonic()
            time.sleep(max(0.0, paused + pause_s - taken))
            os.kill(procs[leader].pid, signal.SIGCONT)
            try:  # it finds the Lease lost and exits; one that does not is stopped after a while
                code = procs[leader].wait(timeout=renew_s + 4 * retry_s + 10)
            except subprocess.TimeoutExpired:
                code = None
            wait_for(lambda: _recovered(cluster, ns), timeout=120, what=f"{ns}: the new leader admits the burst")
            after = [what for at, token, _lease, what in writes.log if token == leader and at > taken]
        finally:
            for p in procs.values():
                if p.poll() is None:
                    os.kill(p.pid, signal.SIGCONT)
                _stop(p)
    damage = _damage(cluster, ns)
    _cleanup(cluster, ns)
    return {"writes after takeover": after, "exit code": code, "takeover s": taken - paused, "damage": damage}


def test_a_paused_leader_writes_nothing_after_the_standby_took_the_lease(cluster: FakeCluster) -> None:
    trials = int(os.environ.get("SIGSTOP_TRIALS", "3"))
    lease_s, renew_s, retry_s = (
        LeaderElector.__init__.__kwdefaults__[k] for k in ("lease_duration", "renew_deadline", "retry_period")
    )
    results = [
        paused_leader_trial(cluster, f"pause-{trial}", lease_s=lease_s, renew_s=renew_s, retry_s=retry_s, pause_s=20.0)
        for trial in range(trials)
    ]
    writes = [len(r["writes after takeover"]) for r in results]
    damage: collections.Counter[str] = collections.Counter()
    for r in results:
        damage.update(r["damage"])
    takeovers = ", ".join(f"{r['takeover s']:.1f}" for r in results)
    print(
        f"\nSIGSTOP of the leader for 20 s mid-commit, {trials} trials (Lease {lease_s:g} s, renew deadline "
        f"{renew_s:g} s): takeover after {takeovers} s; the old "
        f"leader's writes after the takeover per trial {writes}, its exit codes "
        f"{[r['exit code'] for r in results]}"
    )
    print(
        "after the takeover: "
        + ", ".join(
            f"{k} {damage[k]}"
            for k in ("gangs partly admitted", "claims allocated twice", "devices held by two claims")
        )
    )
    assert sum(writes) == 0, [r["writes after takeover"] for r in results]
    assert all(r["exit code"] == 1 for r in results)
    assert sum(damage.values()) == 0, damage
