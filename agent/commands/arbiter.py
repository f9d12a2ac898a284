"""`gpu-dra-agent arbiter`: the queue arbiter (one Deployment per cluster). Flags have environment fallbacks.

With --leader-elect only the holder of the Lease decides; it starts its informers once elected and exits
when it loses the Lease (its Deployment restarts it as a standby), so two arbiters never commit at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from typing import NoReturn, cast

from agent import collector, logs
from agent.arbiter.controller import Arbiter, ArbiterConfig
from agent.arbiter.core.model import GPU_POLICIES, GpuPolicy, Placement
from agent.arbiter.metrics import ArbiterMetrics
from agent.commands.options import SettingError, StartupFailure, option, switch
from agent.commands.signals import stop_on_signals
from agent.commands.uninstall import run_uninstall
from agent.kube.client import RateLimiter
from agent.kube.errors import ApiError
from agent.kube.events import EventRecorder
from agent.kube.kubeconfig import KubeconfigError, connect
from agent.kube.leader import LeaderElector, check_timings
from agent.kube.rest import Rest
from agent.names import COMPONENT, DEFAULT_QUEUE
from agent.reservation.auth import TokenFile, TokenFileError
from agent.reservation.node_service import split_address

log = logging.getLogger("agent.arbiter")


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--kubeconfig", env="KUBECONFIG", help="kubeconfig file; the in-cluster config when absent")
    switch(
        p,
        "--uninstall",
        env="UNINSTALL",
        default=False,
        help="hand the pods that wait for the arbiter to kube-scheduler, then exit: delete the arbiter's "
        "Deployment, its admission gate policy, its fence (DeviceTaintRule) and its Lease, and ungate the "
        "waiting pods (Queues stay); run with an admin --kubeconfig",
    )
    option(
        p,
        "--reservation-token-file",
        env="RESERVATION_TOKEN_FILE",
        default="",
        help="the arbiter's service-account token for the node agents (a projected token, audience "
        "gpu-dra-agent-reservations), read again whenever it changes (required)",
    )
    switch(
        p,
        "--leader-elect",
        env="LEADER_ELECT",
        default=False,
        help="decide only while holding the Lease (run several replicas)",
    )
    option(p, "--leader-elect-namespace", env="POD_NAMESPACE", default="gpu-dra-agent", help="namespace of the Lease")
    # kube-scheduler's names and defaults; a leader writes nothing once its last renewal is renew-deadline old
    option(
        p,
        "--leader-elect-lease-duration",
        env="LEADER_ELECT_LEASE_DURATION",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="how long a standby waits after the leader's last renewal before taking the Lease",
    )
    option(
        p,
        "--leader-elect-renew-deadline",
        env="LEADER_ELECT_RENEW_DEADLINE",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the leader stops writing, and exits, when it has not renewed for this long "
        "(less than the lease duration)",
    )
    option(
        p,
        "--leader-elect-retry-period",
        env="LEADER_ELECT_RETRY_PERIOD",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="seconds between attempts to acquire or renew the Lease",
    )
    option(p, "--metrics-addr", env="METRICS_ADDR", default=":9401", help="Prometheus [host]:port, empty to disable")
    # kube-scheduler's flag names; the arbiter's commit writers must not flood the API server in a burst
    option(
        p,
        "--kube-api-qps",
        env="KUBE_API_QPS",
        type=float,
        default=500.0,
        help="requests a second to the API server, on average (watches excepted)",
    )
    option(
        p,
        "--kube-api-burst",
        env="KUBE_API_BURST",
        type=int,
        default=1000,
        help="requests allowed at once above --kube-api-qps",
    )
    option(p, "--driver-name", env="DRIVER_NAME", default="gpu.nvidia.com", help="DRA driver name")
    option(
        p,
        "--reservation-ttl",
        env="RESERVATION_TTL",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds a node holds an unconfirmed reservation",
    )
    option(
        p,
        "--period",
        env="PERIOD",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between looks when nothing changed: a cycle runs once something falls due",
    )
    option(
        p,
        "--cycle-gap",
        env="CYCLE_GAP",
        type=float,
        default=ArbiterConfig.cycle_gap_s,
        metavar="SECONDS",
        help="least seconds from one cycle's start to the next: changes arriving meanwhile are decided together",
    )
    option(p, "--log-format", env="LOG_FORMAT", choices=logs.FORMATS, default="text", help="json or text")
    option(
        p,
        "--usage-half-life",
        env="USAGE_HALF_LIFE",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time-aware fair share: past usage decays with this half-life and shifts the over-quota "
        "division (kept in each Queue's status); off when absent",
    )
    option(
        p,
        "--usage-k-value",
        env="USAGE_K_VALUE",
        type=float,
        default=1.0,
        help="how strongly past usage shifts the over-quota division (KAI's kValue)",
    )
    option(
        p,
        "--default-queue",
        env="DEFAULT_QUEUE",
        default=DEFAULT_QUEUE,
        help="the Queue a pod that uses the driver's devices but names no queue waits in (the overlay creates "
        "`default`); empty: such pods are left alone",
    )
    option(
        p,
        "--gpu-placement",
        env="GPU_PLACEMENT",
        choices=GPU_POLICIES,
        default="fgd",
        help="how GPU pods choose a node: fgd (least fragmentation growth for the workload the cluster runs, "
        "then a node in use), binpack (fewest free GPUs, KAI's default) or spread",
    )


GATE_POLICY_API = ("admissionregistration.k8s.io/v1", "mutatingadmissionpolicies")


def warn_without_gate_policy(rest: Rest) -> bool:
    """Say once, at start-up, when the server does not serve MutatingAdmissionPolicy: the arbiter overlay's
    policy that gates queue pods then never applies, and kube-scheduler binds them past the arbiter. True when
    it warned."""
    try:
        if rest.serves(*GATE_POLICY_API):
            return False
    except ApiError as exc:
        log.warning("could not check whether the server serves MutatingAdmissionPolicy: %s", exc)
        return False
    log.warning(
        "this cluster does not serve MutatingAdmissionPolicy (admissionregistration.k8s.io/v1, GA and on by default "
        "from Kubernetes 1.36; on 1.34-1.35 start kube-apiserver with --feature-gates=MutatingAdmissionPolicy=true "
        "--runtime-config=admissionregistration.k8s.io/v1beta1=true and apply the policy as v1beta1): pods "
        "labelled scheduling.gpu-dra-agent.io/queue get no scheduling gate and are scheduled past the arbiter; "
        "until then have your workload controller add the gate scheduling.gpu-dra-agent.io/arbiter to them"
    )
    return True


def _fail(message: str) -> NoReturn:
    raise SettingError(message)


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_format)
    if args.uninstall:
        from agent.arbiter.uninstall import ARBITER

        return run_uninstall(args, ARBITER)
    if not args.reservation_token_file:
        return _fail("--reservation-token-file is required: node agents refuse anonymous reservations")
    for flag, value in (("--reservation-ttl", args.reservation_ttl), ("--period", args.period)):
        if not (math.isfinite(value) and value > 0):
            return _fail(f"{flag} must be a positive number of seconds, not {value}")
    if not (math.isfinite(args.cycle_gap) and args.cycle_gap >= 0):
        return _fail(f"--cycle-gap must be a number of seconds at or above 0, not {args.cycle_gap}")
    try:
        check_timings(
            args.leader_elect_lease_duration, args.leader_elect_renew_deadline, args.leader_elect_retry_period
        )
    except ValueError as exc:
        return _fail(str(exc))
    half_life = args.usage_half_life
    if half_life is not None and not (math.isfinite(half_life) and half_life > 0):
        return _fail("--usage-half-life must be a positive number of seconds")
    if not (math.isfinite(args.usage_k_value) and args.usage_k_value >= 0):
        return _fail("--usage-k-value must be a number at or above 0")
    try:
        token = TokenFile(args.reservation_token_file)
        token()  # there and not empty at start; read again whenever kubelet rotates it
        metrics_at = split_address(args.metrics_addr) if args.metrics_addr else None
    except (TokenFileError, ValueError) as exc:
        return _fail(str(exc).replace("--reservation-addr", "--metrics-addr"))
    stop = threading.Event()

    stop_on_signals(stop.set, log)
    if not args.kube_api_qps > 0 or args.kube_api_burst < 1:  # not nan, not zero
        return _fail(
            f"--kube-api-qps must be above 0 and --kube-api-burst at least 1, not {args.kube_api_qps} "
            f"and {args.kube_api_burst}"
        )
    try:
        rest = connect(args.kubeconfig)
    except KubeconfigError as exc:
        return _fail(str(exc))
    rest.client.rate_limit = RateLimiter(args.kube_api_qps, args.kube_api_burst)
    warn_without_gate_policy(rest)
    identity = f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"  # unique, and says which process
    metrics = None
    if metrics_at is not None:
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry()
        metrics = ArbiterMetrics(registry)
        server, _ = start_http_server(metrics_at[1], metrics_at[0], registry=registry)
        log.info("metrics serving", extra={"address": f"{metrics_at[0]}:{server.server_port}"})
    elector = None
    if args.leader_elect:
        elector = LeaderElector(
            rest,
            args.leader_elect_namespace,
            COMPONENT,
            identity,
            lease_duration=args.leader_elect_lease_duration,
            renew_deadline=args.leader_elect_renew_deadline,
            retry_period=args.leader_elect_retry_period,
        )
        # every write of the arbiter (claims, pods, evictions, Queue status, Events, the fence, the nodes'
        # reservations) passes this one check: none leaves a process that could have lost the Lease
        rest = rest.gated(elector.check_leading)
        if not elector.lead(stop):
            return 0
    config = ArbiterConfig(
        driver=args.driver_name,
        ttl_seconds=args.reservation_ttl,
        period_s=args.period,
        cycle_gap_s=args.cycle_gap,
        usage_half_life_s=args.usage_half_life,
        k_value=args.usage_k_value,
        placement=Placement(gpu=cast(GpuPolicy, args.gpu_placement)),
        default_queue=args.default_queue or None,
    )
    arbiter = Arbiter(rest, token, config, metrics=metrics, recorder=EventRecorder(rest, COMPONENT, identity))
    started: dict[str, float] = {}
    process_started = 0.0
    collections = collector.CollectorTime()
    try:
        arbiter.start()
        collector.settle(collector.YOUNG_THRESHOLD)
        collections.install()
        started = thread_cpu_seconds()  # the summary counts from here: the informers' first lists are start-up
        process_started = _process_cpu_seconds()
        log.info("arbiter running", extra={"identity": identity})
        arbiter.run(stop)
    except ApiError as exc:
        raise StartupFailure(str(exc)) from exc
    finally:
        # before stop() ends the commit and informer threads
        threads = {k: v - started.get(k, 0.0) for k, v in thread_cpu_seconds().items()}
        # the whole process over the same span: what threads that ended meanwhile (gRPC's) used is the difference
        process = _process_cpu_seconds() - process_started if started else 0.0
        collections.uninstall()
        arbiter.stop()
        # what an operator (or the benchmark) asks after a run: how much it decided and where the time went
        log.info(
            "arbiter stopped",
            extra={
                "thread_cpu_seconds": {
                    k: round(v, 3) for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v >= 0.001
                },
                "process_cpu_seconds": round(process, 3),
                "gc_cpu_seconds": [round(v, 3) for v in collections.seconds],  # by generation, youngest first
                "gc_collections": collections.collections,
                "cycles": arbiter.cycles,
                "unchanged_cycles": arbiter.unchanged_cycles,
                "skipped_looks": arbiter.skipped_looks,  # nothing changed, nothing due: no cycle
                "evictions": dict(arbiter.evictions),
                "seconds": {k: round(v, 3) for k, v in arbiter.timings.items()},
                "cpu_seconds": {k: round(v, 3) for k, v in arbiter.cpu_timings.items()},
                "commit_seconds": {k: round(v, 3) for k, v in arbiter.commit_timings().items()},
                "commit_cpu_seconds": {k: round(v, 3) for k, v in arbiter.commit_cpu_timings().items()},
            },
        )
        if elector is not None and not elector.lost.is_set():
            elector.release()
    if elector is not None and elector.lost.is_set():
        return 1  # lost the Lease: exit so the Deployment restarts us as a standby
    return 0


def _process_cpu_seconds() -> float:
    own = os.times()
    return own.user + own.system


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by kind: a Python thread by its name without the
    pool's number ("commit", "informer-pods", "MainThread": the cycle), from its own CPU clock (to the
    nanosecond: /proc counts whole ticks per thread, and 100 threads lost a second that way); any other
    (gRPC's) by its OS name, from /proc."""
    python = {t.native_id: t for t in threading.enumerate() if t.native_id is not None and t.ident is not None}
    ticks = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for task in os.scandir("/proc/self/task"):
        thread = python.get(int(task.name))
        try:
            if thread is not None and thread.ident is not None:
                name, seconds = thread.name, time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            else:
                with open(f"{task.path}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"{task.path}/comm") as f:
                    name = f.read().strip()
                seconds = (int(fields[11]) + int(fields[12])) / ticks
        except OSError:  # ended meanwhile
            continue
        name = re.sub(r"[_-]\d+$", "", name)
        out[name] = out.get(name, 0.0) + seconds
    return out
