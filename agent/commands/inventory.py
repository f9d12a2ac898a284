"""`gpu-dra-agent inventory`: what this node's GPUs look like to the driver, as JSON or a table."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from agent.commands.options import StartupFailure, option
from agent.devices.model import Gpu, Inventory, MigDevice
from agent.devices.names import gpu_device_name, mig_device_name
from agent.driver import report
from agent.driver.discovery import DriverVersionMismatch
from agent.driver.startup import set_up
from agent.nvml.errors import NvmlError
from agent.nvml.source import InvalidNvmlSpec, NvmlSpec, open_nvml, parse_nvml_spec

GIB = 2**30
NO_DRIVER_ROOT = "Driver files: none shown (a fake machine; name its driver root with --driver-root)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nvml",
        type=_spec,
        default=parse_nvml_spec("real"),
        metavar="real|fake:MACHINE",
        help="NVML to read: the host's library, or a fake machine such as fake:dgx-h100 (default: real)",
    )
    parser.add_argument("--output", choices=("json", "table"), default="table", help="output format")
    option(
        parser,
        "--driver-root",
        env="NVIDIA_DRIVER_ROOT",
        help="the NVIDIA driver's root, to show the files containers get from it (default: / with real NVML; "
        "none with a fake machine, whose driver is not this host's)",
    )
    option(
        parser,
        "--host-driver-root",
        env="NVIDIA_HOST_DRIVER_ROOT",
        default="/",
        help="the same root as the host sees it",
    )
    option(parser, "--nvidia-cdi-hook-path", env="NVIDIA_CDI_HOOK_PATH", help="host path of nvidia-cdi-hook")


def _spec(text: str) -> NvmlSpec:
    try:
        return parse_nvml_spec(text)
    except InvalidNvmlSpec as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    try:
        with open_nvml(args.nvml) as nvml:
            inventory = nvml.discover()
        # a fake machine's driver is not the host's: its files are shown only from a root named for it
        root = args.driver_root or (None if args.nvml.is_fake else "/")
        driver = (
            set_up(Path(root), args.host_driver_root, inventory.driver_version, args.nvidia_cdi_hook_path)
            if root
            else None
        )
    except (NvmlError, InvalidNvmlSpec, DriverVersionMismatch) as exc:
        raise StartupFailure(str(exc)) from exc
    if args.output == "json":
        files = report.document(driver) if driver else None
        print(json.dumps({**inventory_document(inventory), "driverFiles": files}, indent=2))
    else:
        lines = report.table_lines(driver) if driver else [NO_DRIVER_ROOT]
        print("\n".join([inventory_table(inventory), "", *lines]))
    return 0


def inventory_document(inv: Inventory) -> dict[str, Any]:
    """The inventory as JSON-ready data, device names as the driver publishes them."""
    return {
        "driverVersion": inv.driver_version,
        "cudaDriverVersion": inv.cuda_driver_version,
        "nvmlVersion": inv.nvml_version,
        "gpus": [_gpu_document(g) for g in inv.gpus],
        "migDevices": [_mig_document(m) for m in inv.mig_devices],
        "nvlinkDomains": [
            {"id": d.id, "fabric": d.fabric, "gpus": [gpu_device_name(m) for m in d.gpu_minors]}
            for d in inv.nvlink_domains
        ],
        "unavailableGpus": [{"index": u.index, "reason": u.reason} for u in inv.unavailable_gpus],
    }


def _gpu_document(g: Gpu) -> dict[str, Any]:
    return {
        "name": gpu_device_name(g.minor),
        "uuid": g.uuid,
        "minor": g.minor,
        "index": g.index,
        "productName": g.product_name,
        "brand": g.brand,
        "architecture": g.architecture,
        "cudaComputeCapability": g.cuda_compute_capability,
        "memoryBytes": g.memory_bytes,
        "pciBusID": g.pci_bus_id,
        "pciDeviceID": f"0x{g.pci_device_id:08X}",
        "pcieRoot": g.pcie_root,
        "numaNode": g.numa_node,
        "computeMode": g.compute_mode.name,
        "mpsServer": g.mps_server,
        "migCapable": g.mig_capable,
        "migEnabled": g.mig_enabled,
        "migPending": g.mig_pending,
        "nvlinkDomain": g.nvlink_domain,
        "nvlinkPeers": list(g.nvlink_peers),
        "fabric": {"clusterUUID": g.fabric.cluster_uuid, "cliqueID": g.fabric.clique_id} if g.fabric else None,
        "migProfiles": [
            {
                "name": p.name,
                "giProfileId": p.gi_profile_id,
                "computeSlices": p.compute_slices,
                "memorySlices": p.memory_slices,
                "maxInstances": p.max_instances,
                "memoryBytes": p.memory_bytes,
                "multiprocessors": p.multiprocessors,
                "copyEngines": p.copy_engines,
                "decoders": p.decoders,
                "encoders": p.encoders,
                "jpegEngines": p.jpeg_engines,
                "ofaEngines": p.ofa_engines,
            }
            for p in g.mig_profiles
        ],
        "migPlacements": [
            {
                "name": mig_device_name(g.minor, p.name, p.gi_profile_id, pl.start),
                "profile": p.name,
                "giProfileId": p.gi_profile_id,
                "start": pl.start,
                "size": pl.size,
            }
            for p in g.mig_profiles
            for pl in p.placements
        ],
        "gpuInstances": [
            {
                "id": gi.gpu_instance_id,
                "profile": gi.profile,
                "giProfileId": gi.gi_profile_id,
                "start": gi.placement.start,
                "size": gi.placement.size,
            }
            for gi in g.gpu_instances
        ],
    }


def _mig_document(m: MigDevice) -> dict[str, Any]:
    return {
        "name": m.name,
        "uuid": m.uuid,
        "parentUUID": m.parent_uuid,
        "parentName": gpu_device_name(m.parent_minor),
        "profile": m.profile,
        "giProfileId": m.gi_profile_id,
        "start": m.placement.start,
        "size": m.placement.size,
        "gpuInstanceId": m.gpu_instance_id,
        "computeInstanceId": m.compute_instance_id,
        "memoryBytes": m.memory_bytes,
        "multiprocessors": m.multiprocessors,
        "copyEngines": m.copy_engines,
        "decoders": m.decoders,
        "encoders": m.encoders,
        "jpegEngines": m.jpeg_engines,
        "ofaEngines": m.ofa_engines,
    }


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]


def _slices(start: int, size: int) -> str:
    return str(start) if size == 1 else f"{start}-{start + size - 1}"


def _mig_state(g: Gpu) -> str:
    if not g.mig_capable:
        return "-"
    state = "on" if g.mig_enabled else "off"
    return state if g.mig_enabled == g.mig_pending else f"{state}->{'on' if g.mig_pending else 'off'}"


def inventory_table(inv: Inventory) -> str:
    """The inventory for a person at a terminal."""
    lines = [f"Driver {inv.driver_version}, CUDA {inv.cuda_driver_version}, {len(inv.gpus)} GPU(s)", ""]
    lines += _table(
        (
            "NAME",
            "INDEX",
            "PRODUCT",
            "MEMORY",
            "PCI BUS ID",
            "NUMA",
            "MIG",
            "PLACEMENTS",
            "COMPUTE MODE",
            "MPS",
            "NVLINK DOMAIN",
            "UUID",
        ),
        [
            (
                gpu_device_name(g.minor),
                str(g.index),
                g.product_name,
                f"{g.memory_bytes / GIB:.1f} GiB",
                g.pci_bus_id,
                "-" if g.numa_node is None else str(g.numa_node),
                _mig_state(g),
                str(sum(len(p.placements) for p in g.mig_profiles)),
                g.compute_mode.name,
                "server" if g.mps_server else "-",
                g.nvlink_domain,
                g.uuid,
            )
            for g in inv.gpus
        ],
    )
    if inv.mig_devices:
        lines += ["", "MIG devices:"]
        lines += _table(
            ("NAME", "PROFILE", "SLICES", "MEMORY", "UUID"),
            [
                (
                    m.name,
                    m.profile,
                    _slices(m.placement.start, m.placement.size),
                    f"{m.memory_bytes / GIB:.1f} GiB",
                    m.uuid,
                )
                for m in inv.mig_devices
            ],
        )
    lines += ["", "NVLink domains:"]
    lines += _table(
        ("DOMAIN", "KIND", "GPUS"),
        [
            (d.id, "fabric" if d.fabric else "node", ", ".join(gpu_device_name(m) for m in d.gpu_minors))
            for d in inv.nvlink_domains
        ],
    )
    if inv.unavailable_gpus:
        lines += ["", "Unavailable GPUs (not advertised):"]
        lines += [f"  index {u.index}: {u.reason}" for u in inv.unavailable_gpus]
    return "\n".join(lines)
