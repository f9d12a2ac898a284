"""`gpu-dra-agent node`: the per-node daemon. Every flag has an environment fallback for the DaemonSet."""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import replace
from pathlib import Path

from agent import collector, logs
from agent.claims.checkpoint import CheckpointCorrupt
from agent.commands import preflight
from agent.commands.options import SETTING_EXIT, STARTUP_EXIT, option, switch
from agent.commands.preflight import StartupError
from agent.commands.signals import stop_on_signals
from agent.computedomain.checkpoint import CheckpointCorrupt as DomainCheckpointCorrupt
from agent.computedomain.daemon import IMEX, IMEX_CTL
from agent.computedomain.model import DRIVER as COMPUTE_DOMAIN_DRIVER
from agent.devices import shares
from agent.driver.discovery import DriverVersionMismatch
from agent.kube.errors import ApiError
from agent.kube.kubeconfig import KubeconfigError, connect
from agent.kubelet.sockets import SocketError
from agent.migconfig.files import load_mig_configs
from agent.migconfig.spec import InvalidMigConfig
from agent.names import ARBITER_USER, RESERVATION_AUDIENCE
from agent.node import NodeAgent, NodeConfig
from agent.nvml.errors import NvmlError
from agent.nvml.source import InvalidNvmlSpec, open_nvml
from agent.sharing.mps import MPS_CONTROL
from agent.sharing.smi import NVIDIA_SMI
from agent.slices.build import DEFAULT_DRIVER

log = logging.getLogger("agent.node")

# What the node runs from the driver root: nvidia-smi sets compute modes and time slices (TimeSlicing, MPS)
# and resets GPUs for a MIG mode switch; nvidia-cuda-mps-control runs MPS daemons. Sharing has no switch,
# so both are always needed.
DRIVER_BINARIES = (NVIDIA_SMI, MPS_CONTROL)
# With the GPU driver off the node runs only the IMEX daemons: without them it could serve nothing. (With it on, a
# driver without IMEX still serves GPUs, and a channel claim says why it cannot be prepared.)
IMEX_BINARIES = (IMEX, IMEX_CTL)
# Settings that only the GPU driver reads: given with --no-gpus they would silently do nothing.
GPU_ONLY_SETTINGS = {
    "reservation_addr": "--reservation-addr",
    "partitionable_devices": "--partitionable-devices",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    option(p, "--node-name", env="NODE_NAME", help="this node's name")
    option(p, "--driver-name", env="DRIVER_NAME", default=DEFAULT_DRIVER, help="DRA driver name")
    option(
        p,
        "--nvml",
        env="NVML",
        default="real",
        metavar="real|fake:MACHINE",
        help="NVML to use: the host's library, or a fake machine such as fake:dgx-h100",
    )
    option(p, "--kubeconfig", env="KUBECONFIG", help="kubeconfig file; the in-cluster config when absent")
    option(
        p,
        "--kubelet-root",
        env="KUBELET_ROOT",
        default="/var/lib/kubelet",
        help="the kubelet's root directory, where its plugin sockets live",
    )
    option(p, "--cdi-root", env="CDI_ROOT", default="/var/run/cdi", help="CDI spec directory")
    option(
        p,
        "--state-dir",
        env="STATE_DIR",
        default="/var/run/gpu-dra-agent",
        help="checkpoint directory; claims are void after a reboot, so /run (tmpfs) suits it",
    )
    option(p, "--metrics-addr", env="METRICS_ADDR", default=":9400", help="Prometheus [host]:port, empty to disable")
    option(
        p,
        "--healthcheck-addr",
        env="HEALTHCHECK_ADDR",
        default="",
        help="[host]:port for the gRPC liveness probe, empty to disable",
    )
    option(p, "--log-format", env="LOG_FORMAT", default="text", choices=logs.FORMATS, help="json or text")
    switch(
        p,
        "--partitionable-devices",
        env="PARTITIONABLE_DEVICES",
        default=False,
        help="publish every MIG placement prepare can deliver as a partitionable device (falls back to whole "
        "GPUs where the server drops counters)",
    )
    option(
        p,
        "--consumable-shares",
        env="CONSUMABLE_SHARES",
        default="disabled",
        metavar="disabled|memory|unlimited|N",
        help="publish whole GPUs shareable by many claims (consumable capacity, Kubernetes 1.36+): memory, "
        "unlimited, a share count N, or disabled",
    )
    option(
        p,
        "--additional-xids-to-ignore",
        env="ADDITIONAL_XIDS_TO_IGNORE",
        default="",
        help="comma-separated XIDs that do not make a GPU unhealthy, beyond the application XIDs",
    )
    switch(p, "--health-events", env="HEALTH_EVENTS", default=True, help="watch NVML for critical XIDs and lost GPUs")
    option(
        p,
        "--driver-root",
        env="NVIDIA_DRIVER_ROOT",
        default="/",
        help="where the NVIDIA driver (its libraries, nvidia-smi, nvidia-cuda-mps-control) is installed, as the "
        "agent sees it (the DaemonSet mounts it at /driver-root)",
    )
    option(
        p,
        "--host-driver-root",
        env="NVIDIA_HOST_DRIVER_ROOT",
        default="/",
        help="the same driver root as the container runtime on the host sees it, for the CDI specs' host paths, "
        "as NVIDIA's nvidiaDriverRoot: / or e.g. /run/nvidia/driver",
    )
    option(
        p,
        "--nvidia-cdi-hook-path",
        env="NVIDIA_CDI_HOOK_PATH",
        help="host path of NVIDIA's nvidia-cdi-hook, run by the CDI specs' hooks; default: where NVIDIA's "
        "container toolkit installs it",
    )
    option(
        p,
        "--dev-root",
        env="NVIDIA_DEV_ROOT",
        default="/",
        help="where the host's /dev/nvidia* nodes are, when not at /dev (a driver container's, or stand-ins); "
        "CDI specs then name them as hostPath beneath it",
    )
    option(
        p,
        "--resync-interval",
        env="RESYNC_INTERVAL",
        default=30.0,
        type=float,
        metavar="SECONDS",
        help="seconds between slice resyncs, positive",
    )
    option(
        p,
        "--reservation-addr",
        env="RESERVATION_ADDR",
        default="",
        help="HOST:PORT to serve the arbiter's reservation API on, empty to disable",
    )
    option(
        p,
        "--reservation-audience",
        env="RESERVATION_AUDIENCE",
        default=RESERVATION_AUDIENCE,
        help="the audience the arbiter's service-account token must be for (checked through TokenReview)",
    )
    option(
        p,
        "--arbiter-user",
        env="ARBITER_USER",
        default=ARBITER_USER,
        help="the only user that may reserve devices: the arbiter's service account, "
        "system:serviceaccount:NAMESPACE:NAME",
    )
    option(
        p,
        "--arbiter-namespace",
        env="POD_NAMESPACE",
        default="gpu-dra-agent",
        help="namespace of the queue arbiter's Lease: while no arbiter holds it, one node agent tells the pods "
        "that wait for it, in an Event; empty: never",
    )
    option(
        p,
        "--mig-config-file",
        env="MIG_CONFIG_FILE",
        help="mig-parted v1 configs the nvidia.com/mig.config label names; default: the GPU Operator's",
    )
    switch(
        p,
        "--mig-reconfigure",
        env="MIG_RECONFIGURE",
        default=True,
        help="apply the MIG config the node label nvidia.com/mig.config names",
    )
    switch(
        p,
        "--gpus",
        env="GPUS",
        default=True,
        help="serve the GPU driver (--driver-name): GPU ResourceSlices, its kubelet plugin, MIG reconfiguration and "
        "the arbiter's reservations; --no-gpus leaves the GPUs to another (the GPU Operator's device plugin) and "
        "serves --compute-domains alone, as NVIDIA's chart with resources.gpus.enabled=false",
    )
    switch(
        p,
        "--compute-domains",
        env="COMPUTE_DOMAINS",
        default=False,
        help="also serve compute-domain.nvidia.com: IMEX channels for NVIDIA's ComputeDomains on nodes in a "
        "multi-node NVLink fabric clique, and their IMEX daemons (nvidia-imex from the driver root)",
    )
    option(
        p,
        "--imex-address",
        env="POD_IP",
        default="",
        help="the IP address this node's IMEX daemons listen on and peers reach (the DaemonSet: the pod's IP)",
    )
    option(
        p,
        "--proc-devices",
        env="PROC_DEVICES",
        default="/proc/devices",
        help="the kernel's device list, whose nvidia-caps-imex-channels line gives the IMEX channels' major",
    )
    option(
        p,
        "--imex-channel-count",
        env="IMEX_CHANNEL_COUNT",
        type=int,
        default=2048,
        help="IMEX channels of the node (the driver's NVreg_ImexChannelCount): what allocationMode All injects",
    )


def _xids(text: str) -> frozenset[int]:
    try:
        xids = frozenset(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise StartupError(f"--additional-xids-to-ignore must be comma-separated integers, not {text!r}") from None
    if any(x < 0 for x in xids):
        raise StartupError(f"--additional-xids-to-ignore must list non-negative XIDs, not {text!r}")
    return xids


def _compute_domains_alone(args: argparse.Namespace) -> None:
    """--no-gpus: the compute-domain driver must be on, and no setting of the GPU driver given."""
    if not args.compute_domains:
        raise StartupError(
            "--no-gpus needs --compute-domains (or COMPUTE_DOMAINS=true): with neither driver on the agent would "
            "serve nothing"
        )
    given = [flag for attr, flag in GPU_ONLY_SETTINGS.items() if getattr(args, attr)]
    if args.consumable_shares != "disabled":
        given.append("--consumable-shares")
    if given:
        raise StartupError(f"{', '.join(given)} configure the GPU driver, which --no-gpus turns off")


def _config(args: argparse.Namespace) -> NodeConfig:
    """Every flag checked, nothing touched yet."""
    if not args.node_name:
        raise StartupError("--node-name (or NODE_NAME) is required")
    driver_name = preflight.dns_subdomain("--driver-name", args.driver_name, max_length=63)
    for flag, value in (("--metrics-addr", args.metrics_addr), ("--healthcheck-addr", args.healthcheck_addr)):
        if value:
            preflight.address(flag, value)
    if not args.gpus:
        _compute_domains_alone(args)
    if args.reservation_addr:
        from agent.reservation.node_service import split_address

        try:
            split_address(args.reservation_addr)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        if not args.reservation_audience:
            raise StartupError("--reservation-audience may not be empty: a token for any audience would do")
        user = args.arbiter_user
        if len(user.split(":")) != 4 or not user.startswith("system:serviceaccount:") or not all(user.split(":")):
            raise StartupError(f"--arbiter-user must be system:serviceaccount:NAMESPACE:NAME, not {user!r}")
    try:
        share_mode = shares.parse_mode(args.consumable_shares)
    except shares.ShareError as exc:
        raise StartupError(str(exc)) from None
    if share_mode is not None and args.partitionable_devices:
        raise StartupError(
            f"--consumable-shares={share_mode} cannot be combined with --partitionable-devices: a GPU shared by "
            "claims cannot also be carved into MIG devices at prepare (see DESIGN.md, consumable capacity)"
        )
    try:
        mig_configs = load_mig_configs(args.mig_config_file) if args.mig_reconfigure and args.gpus else None
    except InvalidMigConfig as exc:
        raise StartupError(str(exc)) from None
    if args.compute_domains:
        import ipaddress

        try:
            ipaddress.ip_address(args.imex_address)
        except ValueError:
            raise StartupError(
                f"--compute-domains needs --imex-address (or POD_IP), an IP address, not {args.imex_address!r}"
            ) from None
        if not 1 <= args.imex_channel_count <= 1 << 20:
            raise StartupError(f"--imex-channel-count must be between 1 and 1048576, not {args.imex_channel_count}")
    return NodeConfig(
        gpus=args.gpus,
        compute_domains=args.compute_domains,
        imex_address=args.imex_address,
        proc_devices=Path(args.proc_devices),
        imex_channel_count=args.imex_channel_count,
        node_name=preflight.dns_subdomain("--node-name", args.node_name),
        driver_name=driver_name,
        kubelet_root=Path(args.kubelet_root),
        cdi_root=Path(args.cdi_root),
        state_dir=Path(args.state_dir),
        kubeconfig=args.kubeconfig,
        partitionable=args.partitionable_devices,
        share_mode=share_mode,
        resync_interval_s=preflight.interval("--resync-interval", args.resync_interval),
        liveness_address=args.healthcheck_addr or None,
        health_events=args.health_events,
        extra_ignored_xids=_xids(args.additional_xids_to_ignore),
        driver_root=preflight.driver_binaries(
            "--driver-root", Path(args.driver_root), DRIVER_BINARIES if args.gpus else IMEX_BINARIES
        ),
        dev_root=Path(args.dev_root),
        host_driver_root=preflight.absolute_path("--host-driver-root", args.host_driver_root),
        nvidia_cdi_hook_path=(
            preflight.absolute_path("--nvidia-cdi-hook-path", args.nvidia_cdi_hook_path)
            if args.nvidia_cdi_hook_path
            else None
        ),
        reservation_address=args.reservation_addr or None,
        reservation_audience=args.reservation_audience,
        arbiter_user=args.arbiter_user,
        node_ip=os.environ.get("NODE_IP") or None,  # advertised for a 0.0.0.0 --reservation-addr; no flag
        mig_configs=mig_configs,
        arbiter_namespace=args.arbiter_namespace or None,
    )


def _make_dirs(config: NodeConfig) -> NodeConfig:
    """The directories, created with their modes and checked writable; the last step before the agent runs. The
    kubelet's plugin directories of the drivers served, and only theirs."""
    drivers = [config.driver_name] if config.gpus else []
    if config.compute_domains:
        drivers.append(COMPUTE_DOMAIN_DRIVER)
    kubelet_root = config.kubelet_root
    for driver in drivers:
        kubelet_root = preflight.kubelet_sockets("--kubelet-root", config.kubelet_root, driver)
    return replace(
        config,
        state_dir=preflight.writable_dir("--state-dir", config.state_dir, preflight.STATE_DIR_MODE),
        cdi_root=preflight.writable_dir("--cdi-root", config.cdi_root, preflight.CDI_ROOT_MODE),
        kubelet_root=kubelet_root,
    )


def _serve(config: NodeConfig, metrics_addr: str, nvml_spec: str) -> None:
    """Open NVML and the API client and probe the addresses (none of which leaves a trace), then make the
    directories and run the agent until a signal stops it."""
    with open_nvml(nvml_spec) as nvml:
        rest = connect(config.kubeconfig)
        for flag, value in (("--metrics-addr", metrics_addr), ("--healthcheck-addr", config.liveness_address)):
            if value:
                preflight.can_listen(flag, value)
        config = _make_dirs(config)
        agent = NodeAgent(config, nvml, rest=rest)
        if metrics_addr:
            from prometheus_client import start_http_server

            host, port = preflight.address("--metrics-addr", metrics_addr)
            try:
                metrics_server, _ = start_http_server(port, host, registry=agent.metrics.registry)
            except OSError as exc:  # taken since the probe
                raise StartupError(f"cannot listen on --metrics-addr {metrics_addr}: {exc.strerror or exc}") from None
            # The bound port, so `--metrics-addr 127.0.0.1:0` is usable (tests, several agents on one host).
            log.info("metrics serving", extra={"address": f"{host}:{metrics_server.server_port}"})

        stop_on_signals(agent.stop, log)
        collector.settle()
        agent.run()


# Failures an operator causes and can fix: the message is the whole story. Settings that cannot work (exit 2)
# and failures at start-up (exit 1).
_SETTING_ERRORS = (StartupError, KubeconfigError, InvalidNvmlSpec, DriverVersionMismatch)
_STARTUP_FAILURES = (NvmlError, CheckpointCorrupt, DomainCheckpointCorrupt, ApiError, SocketError)
PREFIX = "gpu-dra-agent node"


def run(args: argparse.Namespace) -> int:
    """0 after a clean shutdown; otherwise one log record saying why (JSON with --log-format json), never a
    traceback: 2 for a setting that cannot work, 1 for a failure at start-up."""
    logs.setup(args.log_format)  # argparse checked the choice, the environment's value included
    try:
        _serve(_config(args), args.metrics_addr, args.nvml)
    except _SETTING_ERRORS as exc:
        log.critical("%s: %s", PREFIX, exc)
        return SETTING_EXIT
    except _STARTUP_FAILURES as exc:
        log.critical("%s: %s", PREFIX, exc)
        return STARTUP_EXIT
    except OSError as exc:  # e.g. a port taken since it was probed
        log.critical("%s: %s", PREFIX, exc)
        return STARTUP_EXIT
    except Exception as exc:  # a bug: still one line for the operator, the traceback for whoever debugs it
        log.debug("start-up failed", exc_info=True)
        log.critical("%s: failed: %s: %s", PREFIX, type(exc).__name__, exc)
        return STARTUP_EXIT
    return 0
