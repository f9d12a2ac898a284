"""`gpu-dra-agent arbiter`: the queue arbiter (one Deployment per cluster). Flags have environment fallbacks.

With --leader-elect only the holder of the Lease decides; it starts its informers once elected and exits
when it loses the Lease (its Deployment restarts it as a standby), so two arbiters never commit at once.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
import uuid
from types import FrameType
from typing import cast

from agent import logs
from agent.arbiter.controller import Arbiter, ArbiterConfig
from agent.arbiter.core.model import GPU_POLICIES, GpuPolicy, Placement
from agent.arbiter.metrics import ArbiterMetrics
from agent.arbiter.names import COMPONENT, DEFAULT_QUEUE
from agent.arbiter.node_service import TokenFileError, read_token, split_address
from agent.kube.client import api_client
from agent.kube.errors import ApiError
from agent.kube.events import EventRecorder
from agent.kube.leader import LeaderElector
from agent.kube.rest import Rest

log = logging.getLogger("agent.arbiter")


def _env(name: str, default: str = "") -> str:
    return os.environ.get(name) or default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", default=_env("KUBECONFIG") or None, help="kubeconfig; in-cluster when absent")
    p.add_argument("--reservation-token-file", default=_env("RESERVATION_TOKEN_FILE"),
                   help="file holding the bearer token the node agents expect (env RESERVATION_TOKEN_FILE)")
    p.add_argument("--leader-elect", action="store_true", default=_env("LEADER_ELECT") in ("1", "true"),
                   help="decide only while holding the Lease (run several replicas)")
    p.add_argument("--leader-elect-namespace", default=_env("POD_NAMESPACE", "gpu-dra-agent"),
                   help="namespace of the Lease (env POD_NAMESPACE)")
    p.add_argument("--metrics-addr", default=_env("METRICS_ADDR", ":9401"),
                   help="Prometheus [host]:port, empty to disable (env METRICS_ADDR)")
    p.add_argument("--driver-name", default=_env("DRIVER_NAME", "gpu.nvidia.com"), help="DRA driver name")
    p.add_argument("--reservation-ttl", type=float, default=30.0,
                   help="seconds a node holds an unconfirmed reservation")
    p.add_argument("--period", type=float, default=1.0, help="seconds between cycles when nothing changes")
    p.add_argument("--log-format", choices=("json", "text"), default=_env("LOG_FORMAT", "text"))
    p.add_argument("--usage-half-life", type=float, default=None, metavar="SECONDS",
                   help="time-aware fair share: past usage decays with this half-life and shifts the over-quota "
                        "division (kept in each Queue's status); off when absent")
    p.add_argument("--usage-k-value", type=float, default=1.0,
                   help="how strongly past usage shifts the over-quota division (KAI's kValue, default 1)")
    p.add_argument("--default-queue", default=_env("DEFAULT_QUEUE", DEFAULT_QUEUE),
                   help="the Queue a pod that uses the driver's devices but names no queue waits in (the overlay "
                        "creates `default`); empty: such pods are left alone")
    p.add_argument("--gpu-placement", choices=GPU_POLICIES, default=_env("GPU_PLACEMENT", "fgd"),
                   help="how GPU pods choose a node: fgd (default; least fragmentation growth for the workload "
                        "the cluster runs, then a node in use), binpack (fewest free GPUs, KAI's default) "
                        "or spread")


def _fail(message: str) -> int:
    print(f"gpu-dra-agent arbiter: {message}", file=sys.stderr)
    return 2


def _stop_when(lost: threading.Event, stop: threading.Event) -> None:
    lost.wait()
    stop.set()


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_format)
    if not args.reservation_token_file:
        return _fail("--reservation-token-file is required: node agents refuse anonymous reservations")
    if not all(math.isfinite(v) and v > 0 for v in (args.reservation_ttl, args.period)):
        return _fail("--reservation-ttl and --period must be positive")
    half_life = args.usage_half_life
    if half_life is not None and not (math.isfinite(half_life) and half_life > 0):
        return _fail("--usage-half-life must be a positive number of seconds")
    if not (math.isfinite(args.usage_k_value) and args.usage_k_value >= 0):
        return _fail("--usage-k-value must be a number at or above 0")
    if args.gpu_placement not in GPU_POLICIES:  # GPU_PLACEMENT from the environment skips argparse's check
        return _fail(f"--gpu-placement must be one of {', '.join(GPU_POLICIES)}, not {args.gpu_placement!r}")
    try:
        token = read_token(args.reservation_token_file)
        metrics_at = split_address(args.metrics_addr) if args.metrics_addr else None
    except (TokenFileError, ValueError) as exc:
        return _fail(str(exc).replace("--reservation-addr", "--metrics-addr"))
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        rest = Rest(api_client(args.kubeconfig))
    except Exception as exc:  # a malformed kubeconfig: the client raises many kinds
        return _fail(f"cannot load the kubeconfig: {exc}")
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
        elector = LeaderElector(rest, args.leader_elect_namespace, COMPONENT, identity)
        threading.Thread(target=elector.run, args=(stop,), name="leader-election", daemon=True).start()
        while not elector.leading.wait(0.5):
            if stop.is_set():
                return 0
    config = ArbiterConfig(driver=args.driver_name, ttl_seconds=args.reservation_ttl, period_s=args.period,
                           usage_half_life_s=args.usage_half_life, k_value=args.usage_k_value,
                           placement=Placement(gpu=cast(GpuPolicy, args.gpu_placement)),
                           default_queue=args.default_queue or None)
    arbiter = Arbiter(rest, token, config, metrics=metrics, recorder=EventRecorder(rest, COMPONENT, identity))
    try:
        arbiter.start()
        log.info("arbiter running", extra={"identity": identity})
        if elector is not None:
            threading.Thread(target=_stop_when, args=(elector.lost, stop), daemon=True).start()
        arbiter.run(stop)
    except ApiError as exc:
        print(f"gpu-dra-agent arbiter: {exc}", file=sys.stderr)
        return 1
    finally:
        arbiter.stop()
        if elector is not None and not elector.lost.is_set():
            elector.release()
    if elector is not None and elector.lost.is_set():
        return 1  # lost the Lease: exit so the Deployment restarts us as a standby
    return 0
