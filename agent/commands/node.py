"""`gpu-dra-agent node`: the per-node daemon. Every flag has an environment fallback for the DaemonSet."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path
from types import FrameType

from agent import logs
from agent.claims.checkpoint import CheckpointCorrupt
from agent.commands import preflight
from agent.commands.preflight import StartupError
from agent.devices import shares
from agent.driver.discovery import DriverVersionMismatch
from agent.kube.client import KubeconfigError, api_client
from agent.kube.errors import ApiError
from agent.kubelet.sockets import SocketError
from agent.migconfig.files import load_mig_configs
from agent.migconfig.spec import InvalidMigConfig
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


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-name", default=_env("NODE_NAME"), help="this node's name (env NODE_NAME)")
    p.add_argument(
        "--driver-name", default=_env("DRIVER_NAME", DEFAULT_DRIVER), help="DRA driver name (env DRIVER_NAME)"
    )
    p.add_argument("--nvml", default=_env("NVML", "real"), help="real or fake:<machine> (env NVML)")
    p.add_argument("--kubeconfig", default=_env("KUBECONFIG"), help="kubeconfig; in-cluster config when absent")
    p.add_argument("--kubelet-root", default=_env("KUBELET_ROOT", "/var/lib/kubelet"), help="env KUBELET_ROOT")
    p.add_argument("--cdi-root", default=_env("CDI_ROOT", "/var/run/cdi"), help="CDI spec directory (env CDI_ROOT)")
    p.add_argument(
        "--state-dir",
        default=_env("STATE_DIR", "/var/run/gpu-dra-agent"),
        help="checkpoint directory; claims are void after a reboot, so /run (tmpfs) suits it (env STATE_DIR)",
    )
    p.add_argument(
        "--metrics-addr", default=_env("METRICS_ADDR", ":9400"), help="Prometheus [host]:port, empty to disable"
    )
    p.add_argument(
        "--healthcheck-addr",
        default=_env("HEALTHCHECK_ADDR", ""),
        help="[host]:port for the gRPC liveness probe, empty to disable (env HEALTHCHECK_ADDR)",
    )
    p.add_argument(
        "--log-format", choices=logs.FORMATS, default=_env("LOG_FORMAT", "text"), help="json or text (env LOG_FORMAT)"
    )
    p.add_argument(
        "--partitionable-devices",
        action="store_true",
        default=_env("PARTITIONABLE_DEVICES", "") in ("1", "true"),
        help="publish possible MIG placements with sharedCounters (alpha in 1.34; falls back if dropped)",
    )
    p.add_argument(
        "--consumable-shares",
        default=_env("CONSUMABLE_SHARES", "disabled"),
        help="publish whole GPUs shareable by many claims (consumable capacity, Kubernetes 1.36+): memory, "
        "unlimited, a share count N, or disabled (env CONSUMABLE_SHARES)",
    )
    p.add_argument(
        "--additional-xids-to-ignore",
        default=_env("ADDITIONAL_XIDS_TO_IGNORE", ""),
        help="comma-separated XIDs that do not make a GPU unhealthy, beyond the application XIDs",
    )
    p.add_argument(
        "--health-events",
        action=argparse.BooleanOptionalAction,
        default=_env("HEALTH_EVENTS", "true") not in ("0", "false"),
        help="watch NVML for critical XIDs and lost GPUs (env HEALTH_EVENTS)",
    )
    p.add_argument(
        "--driver-root",
        default=_env("NVIDIA_DRIVER_ROOT", "/"),
        help="where the NVIDIA driver (its libraries, nvidia-smi, nvidia-cuda-mps-control) is installed, as the "
        "agent sees it (the DaemonSet mounts it at /driver-root) (env NVIDIA_DRIVER_ROOT)",
    )
    p.add_argument(
        "--host-driver-root",
        default=_env("NVIDIA_HOST_DRIVER_ROOT", "/"),
        help="the same driver root as the container runtime on the host sees it, for the CDI specs' host paths, "
        "as NVIDIA's nvidiaDriverRoot: / or e.g. /run/nvidia/driver (env NVIDIA_HOST_DRIVER_ROOT)",
    )
    p.add_argument(
        "--nvidia-cdi-hook-path",
        default=_env("NVIDIA_CDI_HOOK_PATH"),
        help="host path of NVIDIA's nvidia-cdi-hook, run by the CDI specs' hooks; default: where NVIDIA's "
        "container toolkit installs it (env NVIDIA_CDI_HOOK_PATH)",
    )
    p.add_argument(
        "--dev-root",
        default=_env("NVIDIA_DEV_ROOT", "/"),
        help="where the host's /dev/nvidia* nodes are, when not at /dev (a driver container's, or stand-ins); "
        "CDI specs then name them as hostPath beneath it (env NVIDIA_DEV_ROOT)",
    )
    p.add_argument("--resync-interval", type=float, default=30.0, help="seconds between slice resyncs")
    p.add_argument(
        "--reservation-addr",
        default=_env("RESERVATION_ADDR", ""),
        help="HOST:PORT to serve the arbiter's reservation API on, empty to disable (env RESERVATION_ADDR)",
    )
    p.add_argument(
        "--reservation-token-file",
        default=_env("RESERVATION_TOKEN_FILE", ""),
        help="file holding the bearer token the arbiter presents (env RESERVATION_TOKEN_FILE)",
    )
    p.add_argument(
        "--mig-config-file",
        default=_env("MIG_CONFIG_FILE"),
        help="mig-parted v1 configs the nvidia.com/mig.config label names; default: the GPU Operator's "
        "(env MIG_CONFIG_FILE)",
    )
    p.add_argument(
        "--mig-reconfigure",
        action=argparse.BooleanOptionalAction,
        default=_env("MIG_RECONFIGURE", "true") not in ("0", "false"),
        help="apply the MIG config the node label nvidia.com/mig.config names (env MIG_RECONFIGURE)",
    )


def _xids(text: str) -> frozenset[int]:
    try:
        xids = frozenset(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise StartupError(f"--additional-xids-to-ignore must be comma-separated integers, not {text!r}") from None
    if any(x < 0 for x in xids):
        raise StartupError(f"--additional-xids-to-ignore must list non-negative XIDs, not {text!r}")
    return xids


def _config(args: argparse.Namespace) -> NodeConfig:
    """Every flag checked, nothing touched yet."""
    if not args.node_name:
        raise StartupError("--node-name (or NODE_NAME) is required")
    driver_name = preflight.dns_subdomain("--driver-name", args.driver_name, max_length=63)
    for flag, value in (("--metrics-addr", args.metrics_addr), ("--healthcheck-addr", args.healthcheck_addr)):
        if value:
            preflight.address(flag, value)
    token = ""
    if args.reservation_addr:
        from agent.arbiter.node_service import TokenFileError, read_token, split_address

        try:
            split_address(args.reservation_addr)
            if not args.reservation_token_file:
                raise TokenFileError("--reservation-addr needs --reservation-token-file: no anonymous reservations")
            token = read_token(args.reservation_token_file)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
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
        mig_configs = load_mig_configs(args.mig_config_file) if args.mig_reconfigure else None
    except InvalidMigConfig as exc:
        raise StartupError(str(exc)) from None
    return NodeConfig(
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
        driver_root=preflight.driver_binaries("--driver-root", Path(args.driver_root), DRIVER_BINARIES),
        dev_root=Path(args.dev_root),
        host_driver_root=preflight.absolute_path("--host-driver-root", args.host_driver_root),
        nvidia_cdi_hook_path=(
            preflight.absolute_path("--nvidia-cdi-hook-path", args.nvidia_cdi_hook_path)
            if args.nvidia_cdi_hook_path
            else None
        ),
        reservation_address=args.reservation_addr or None,
        reservation_token=token,
        node_ip=_env("NODE_IP"),
        mig_configs=mig_configs,
    )


def _make_dirs(config: NodeConfig) -> NodeConfig:
    """The directories, created with their modes and checked writable; the last step before the agent runs."""
    return replace(
        config,
        state_dir=preflight.writable_dir("--state-dir", config.state_dir, preflight.STATE_DIR_MODE),
        cdi_root=preflight.writable_dir("--cdi-root", config.cdi_root, preflight.CDI_ROOT_MODE),
        kubelet_root=preflight.kubelet_sockets("--kubelet-root", config.kubelet_root, config.driver_name),
    )


def _serve(config: NodeConfig, metrics_addr: str, nvml_spec: str) -> None:
    """Open NVML and the API client and probe the addresses (none of which leaves a trace), then make the
    directories and run the agent until a signal stops it."""
    with open_nvml(nvml_spec) as nvml:
        api = api_client(config.kubeconfig)
        for flag, value in (("--metrics-addr", metrics_addr), ("--healthcheck-addr", config.liveness_address)):
            if value:
                preflight.can_listen(flag, value)
        config = _make_dirs(config)
        agent = NodeAgent(config, nvml, api=api)
        if metrics_addr:
            from prometheus_client import start_http_server

            host, port = preflight.address("--metrics-addr", metrics_addr)
            try:
                metrics_server, _ = start_http_server(port, host, registry=agent.metrics.registry)
            except OSError as exc:  # taken since the probe
                raise StartupError(f"cannot listen on --metrics-addr {metrics_addr}: {exc.strerror or exc}") from None
            # The bound port, so `--metrics-addr 127.0.0.1:0` is usable (tests, several agents on one host).
            log.info("metrics serving", extra={"address": f"{host}:{metrics_server.server_port}"})

        def on_signal(signum: int, frame: FrameType | None) -> None:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            agent.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        agent.run()


# Failures an operator causes and can fix: the message is the whole story.
_OPERATOR_ERRORS = (StartupError, KubeconfigError, InvalidNvmlSpec, NvmlError, CheckpointCorrupt, ApiError, SocketError)


def run(args: argparse.Namespace) -> int:
    """0 after a clean shutdown; otherwise one log record saying why (JSON with --log-format json), never a
    traceback: 2 for a setting that cannot work, 1 for a failure at start-up."""
    try:
        logs.setup(args.log_format)
    except ValueError as exc:
        print(f"gpu-dra-agent node: --log-format (or LOG_FORMAT): {exc}", file=sys.stderr)
        return 2
    try:
        _serve(_config(args), args.metrics_addr, args.nvml)
    except (StartupError, DriverVersionMismatch) as exc:  # a setting that cannot work
        log.critical("%s", exc)
        return 2
    except _OPERATOR_ERRORS as exc:
        log.critical("%s", exc)
        return 1
    except OSError as exc:  # e.g. a port taken since it was probed
        log.critical("gpu-dra-agent node: %s", exc)
        return 1
    except Exception as exc:  # a bug: still one line for the operator, the traceback for whoever debugs it
        log.debug("start-up failed", exc_info=True)
        log.critical("gpu-dra-agent node failed: %s: %s", type(exc).__name__, exc)
        return 1
    return 0
