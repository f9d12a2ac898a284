"""Builders shared by the claims tests: a small inventory, ResourceClaims in API JSON, a CDI validator.

(Named test_claims_* to stay inside the claims area; it holds no tests itself.)
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence
from typing import Any

from agent.devices.model import Gpu, Inventory, MigDevice, MigPlacement
from tests.factories import h100

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
API_VERSION = "resource.nvidia.com/v1beta1"


def gpu(minor: int, *, mig_enabled: bool = False) -> Gpu:
    return h100(minor, uuid=f"GPU-{minor:08d}-0000-0000-0000-000000000000", mig_capable=True, mig_enabled=mig_enabled)


def mig(parent: int, gi: int, start: int, *, profile: str = "1g.10gb", gi_profile_id: int = 19) -> MigDevice:
    return MigDevice(
        uuid=f"MIG-{parent:04d}{gi:04d}-0000-0000-0000-000000000000",
        parent_uuid=gpu(parent).uuid,
        parent_minor=parent,
        parent_index=parent,
        profile=profile,
        gi_profile_id=gi_profile_id,
        placement=MigPlacement(start, 1),
        gpu_instance_id=gi,
        compute_instance_id=0,
        memory_bytes=10 * 2**30,
        multiprocessors=16,
        copy_engines=1,
        decoders=1,
        encoders=0,
        jpeg_engines=1,
        ofa_engines=0,
    )


def inventory(full_gpus: int = 4, mig_parent: int | None = 4) -> Inventory:
    """GPUs 0..full_gpus-1, plus GPU `mig_parent` in MIG mode with two 1g.10gb devices (GI 9 and 10)."""
    gpus = [gpu(i) for i in range(full_gpus)]
    migs: list[MigDevice] = []
    if mig_parent is not None:
        gpus.append(gpu(mig_parent, mig_enabled=True))
        migs = [mig(mig_parent, 9, 0), mig(mig_parent, 10, 1)]
    return Inventory(driver_version="550.54.15", cuda_driver_version="12.4", gpus=tuple(gpus), mig_devices=tuple(migs))


def opaque(
    kind: str = "GpuConfig",
    requests: Sequence[str] = (),
    source: str = "FromClaim",
    driver: str = DRIVER,
    **fields: Any,
) -> dict[str, Any]:
    """One `status.allocation.devices.config` entry."""
    entry: dict[str, Any] = {
        "source": source,
        "opaque": {"driver": driver, "parameters": {"apiVersion": API_VERSION, "kind": kind, **fields}},
    }
    if requests:
        entry["requests"] = list(requests)
    return entry


def claim(
    uid: str,
    devices: Sequence[str] = ("gpu-0",),
    *,
    name: str | None = None,
    namespace: str = "default",
    request: str = "gpu",
    driver: str = DRIVER,
    pool: str = NODE,
    configs: Sequence[dict[str, Any]] = (),
    allocated: bool = True,
    extra_results: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    """A ResourceClaim as the API returns it, allocated (unless told) with `devices` for `request`."""
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name or f"claim-{uid}", "namespace": namespace, "uid": uid},
        "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {},
    }
    if allocated:
        results = [{"request": request, "driver": driver, "pool": pool, "device": d} for d in devices]
        body["status"]["allocation"] = {
            "devices": {"results": results + list(extra_results), "config": list(configs)},
            "nodeSelector": {
                "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [pool]}]}]
            },
        }
    return body


def cdi_validator(shared_dir: pathlib.Path) -> Any:
    """A jsonschema validator for CDI specs, with defs.json resolved beside schema.json."""
    import jsonschema
    from referencing import Registry
    from referencing.jsonschema import DRAFT7

    cdi_dir = shared_dir / "data" / "cdi"
    schema = json.loads((cdi_dir / "schema.json").read_text())
    defs = DRAFT7.create_resource(json.loads((cdi_dir / "defs.json").read_text()))
    registry = Registry().with_resource("defs.json", defs)
    return jsonschema.Draft7Validator(schema, registry=registry)
