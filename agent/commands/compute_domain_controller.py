"""`gpu-dra-agent compute-domain-controller`: the ComputeDomain controller (agent.computedomain.controller).

With --leader-elect (the Deployment's setting) only the holder of the Lease gpu-dra-compute-domains writes; it
exits when it loses the Lease, so the Deployment starts it again as a standby."""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import threading
import uuid

from agent import logs
from agent.commands.options import SettingError, StartupFailure, option, switch
from agent.commands.signals import stop_on_signals
from agent.commands.uninstall import run_uninstall
from agent.computedomain.controller import COMPONENT, ComputeDomainController
from agent.kube.errors import ApiError
from agent.kube.events import EventRecorder
from agent.kube.kubeconfig import KubeconfigError, connect
from agent.kube.leader import LeaderElector

log = logging.getLogger("agent.compute_domain_controller")


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--kubeconfig", env="KUBECONFIG", help="kubeconfig file; the in-cluster config when absent")
    option(
        p,
        "--period",
        env="PERIOD",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between passes over every ComputeDomain (changes are handled at once)",
    )
    switch(
        p,
        "--leader-elect",
        env="LEADER_ELECT",
        default=True,
        help="only the holder of the Lease gpu-dra-compute-domains writes (run two replicas)",
    )
    option(p, "--leader-elect-namespace", env="POD_NAMESPACE", default="gpu-dra-agent", help="namespace of the Lease")
    switch(
        p,
        "--uninstall",
        env="UNINSTALL",
        default=False,
        help="take the controller away, then exit: delete its Deployment, wait until no replica holds its Lease, "
        "remove its finalizer from every ComputeDomain and the ResourceClaimTemplates it made, delete the Lease "
        "(helm uninstall runs this first); run with an admin --kubeconfig",
    )
    option(p, "--log-format", env="LOG_FORMAT", default="text", choices=logs.FORMATS, help="json or text")


def run(args: argparse.Namespace) -> int:
    logs.setup(args.log_format)
    if args.uninstall:
        from agent.computedomain.uninstall import COMPUTE_DOMAIN_CONTROLLER

        return run_uninstall(args, COMPUTE_DOMAIN_CONTROLLER)
    if not (math.isfinite(args.period) and args.period > 0):
        raise SettingError(f"--period must be a positive number of seconds, not {args.period}")
    try:
        rest = connect(args.kubeconfig)
    except KubeconfigError as exc:
        raise SettingError(str(exc)) from exc
    stop = threading.Event()
    stop_on_signals(stop.set, log)
    identity = f"{socket.gethostname()}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    elector = None
    if args.leader_elect:
        elector = LeaderElector(rest, args.leader_elect_namespace, COMPONENT, identity)
        rest = rest.gated(elector.check_leading)  # no write leaves a process that may have lost the Lease
        if not elector.lead(stop):
            return 0
    controller = ComputeDomainController(rest, period_s=args.period, recorder=EventRecorder(rest, COMPONENT, identity))
    try:
        controller.start()
        log.info("compute-domain controller running", extra={"identity": identity})
        controller.run(stop)
    except ApiError as exc:
        raise StartupFailure(str(exc)) from exc
    finally:
        controller.stop()
        if elector is not None and not elector.lost.is_set():
            elector.release()
    return 1 if elector is not None and elector.lost.is_set() else 0
