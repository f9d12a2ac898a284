"""FAKE_NVML_STATE: the fake GPUs' state in a file, so it outlives the process and is shared between processes.

A real GPU keeps its MIG mode, GPU/compute instances, compute mode and time slice while the agent that made
them is killed and restarted; so does a fake that uses a state file. Every process using the same file (the
agent, `python -m fakes.nvml`, the fake nvidia-smi and nvidia-cuda-mps-control) sees one set of GPUs.

Protocol:
- Writers take an exclusive flock on `<file>.lock`, re-read the file if another process changed it, change
  the GPUs, write a temporary file and rename it over the state (a kill -9 leaves the old or the new state,
  never half of one). Each write stamps the file's mtime with a strictly increasing generation.
- Readers take no lock: a `stat` per NVML call tells whether the generation moved; only then is the file
  read again. Objects that did not change are kept, so handles to them stay valid, as on a real driver.
- No fsync: the state has to survive a killed process, not a power cut (the GPUs would not either).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import time
from collections.abc import Iterator
from typing import Any

from fakes.nvml.state import ComputeInstance, FabricState, FakeGpu, GpuInstance, Process

FORMAT_VERSION = 1
ENV = "FAKE_NVML_STATE"

# (gpu index, event type, event data, gpu instance id, compute instance id)
PendingEvent = tuple[int, int, int, int, int]


class StateFileError(ValueError):
    """The state file cannot be used: unreadable, from another machine profile, or of another format."""


class StateFile:
    """One state file and what this process last read from it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.generation = -1  # the newest generation read or written here (writes go above it)
        self.seen_mtime_ns = -1  # the file's mtime when this process's objects last matched it
        self._locked = False

    # --- locking --------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the cross-process write lock (re-entrant within this object)."""
        if self._locked:
            yield
            return
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._locked = True
            try:
                yield
            finally:
                self._locked = False
        finally:
            os.close(fd)  # closing releases the flock

    # --- reading --------------------------------------------------------------------------------------

    def read_if_changed(self) -> dict[str, Any] | None:
        """The file's content if another process wrote it since this one last read or wrote it, else None."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return None
        if mtime == self.seen_mtime_ns:
            return None
        data = self.read()
        self.seen_mtime_ns = mtime  # a write between stat and read only causes one more read later
        return data

    def read(self) -> dict[str, Any] | None:
        """The file's content, or None when it does not exist."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateFileError(f"cannot read fake NVML state {self.path}: {exc.strerror}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StateFileError(f"fake NVML state {self.path} is not JSON: {exc}") from exc
        if not isinstance(data, dict) or data.get("version") != FORMAT_VERSION:
            raise StateFileError(f"fake NVML state {self.path} is not format version {FORMAT_VERSION}")
        self.generation = max(self.generation, int(data.get("generation", 0)))
        return data

    # --- writing --------------------------------------------------------------------------------------

    def write(self, data: dict[str, Any]) -> None:
        """Replace the state atomically; call with the exclusive lock held."""
        generation = max(time.time_ns(), self.generation + 1)
        data = {**data, "version": FORMAT_VERSION, "generation": generation}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(data, separators=(",", ":")))
            os.utime(tmp, ns=(generation, generation))
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.generation = self.seen_mtime_ns = generation


def dump(machine_name: str, gpus: list[FakeGpu], pending: list[PendingEvent]) -> dict[str, Any]:
    return {
        "machine": machine_name,
        "gpus": [_dump_gpu(g) for g in gpus],
        "pendingEvents": [list(e) for e in pending],
    }


def _dump_gpu(gpu: FakeGpu) -> dict[str, Any]:
    return {
        "uuid": gpu.uuid,
        "migMode": {"current": gpu.mig_current, "pending": gpu.mig_pending},
        "computeMode": gpu.compute_mode,
        "timeslice": gpu.timeslice,
        "lost": gpu.lost,
        "serial": gpu._serial,
        **(
            {
                "fabric": {
                    "clusterUuid": gpu.fabric.cluster_uuid.hex(),
                    "cliqueId": gpu.fabric.clique_id,
                    "state": gpu.fabric.state,
                    "status": gpu.fabric.status,
                    "healthMask": gpu.fabric.health_mask,
                }
            }
            if gpu.fabric is not None
            else {}
        ),
        "gpuInstances": [
            {
                "id": gi.id,
                "profileId": gi.profile.id,
                "profile": gi.profile.name,
                "placement": {"start": gi.start, "size": gi.size},
                "computeInstances": [
                    {
                        "id": ci.id,
                        "profileId": ci.profile.enum,
                        "profile": ci.profile.name,
                        "start": ci.start,
                        "uuid": ci.uuid,
                    }
                    for ci in sorted(gi.compute_instances.values(), key=lambda c: c.id)
                ],
            }
            for gi in sorted(gpu.gpu_instances.values(), key=lambda g: g.id)
        ],
        "processes": [
            {
                "pid": p.pid,
                "usedBytes": p.used_bytes,
                "gpuInstanceId": p.gpu_instance_id,
                "computeInstanceId": p.compute_instance_id,
                "name": p.name,
                "tracked": p.tracked,
            }
            for p in gpu.processes
        ],
    }


def load(data: dict[str, Any], machine_name: str, gpus: list[FakeGpu]) -> list[PendingEvent]:
    """Make `gpus` match `data` in place, keeping the objects of unchanged instances; returns pending events."""
    if data.get("machine") != machine_name:
        raise StateFileError(f"the fake NVML state holds machine {data.get('machine')!r}, not {machine_name!r}")
    rows = data.get("gpus")
    if not isinstance(rows, list) or len(rows) != len(gpus):
        raise StateFileError(f"the fake NVML state does not hold the {len(gpus)} GPUs of {machine_name}")
    try:
        for gpu, row in zip(gpus, rows, strict=True):
            _load_gpu(gpu, row)
        return [tuple(int(v) for v in e) for e in data.get("pendingEvents", [])]  # type: ignore[misc]
    except (KeyError, TypeError, ValueError, StopIteration) as exc:
        raise StateFileError(f"the fake NVML state is malformed: {exc!r}") from exc


def _load_gpu(gpu: FakeGpu, row: dict[str, Any]) -> None:
    if row["uuid"] != gpu.uuid:
        raise StateFileError(f"GPU {gpu.index} is {row['uuid']} in the state file, {gpu.uuid} in the profile")
    gpu.mig_current, gpu.mig_pending = int(row["migMode"]["current"]), int(row["migMode"]["pending"])
    gpu.compute_mode, gpu.timeslice = int(row["computeMode"]), int(row["timeslice"])
    gpu.lost, gpu._serial = bool(row["lost"]), int(row["serial"])
    fabric = row.get("fabric")  # absent: the machine profile's
    gpu.fabric = (
        None
        if fabric is None
        else FabricState(
            bytes.fromhex(fabric["clusterUuid"]),
            int(fabric["cliqueId"]),
            int(fabric["state"]),
            int(fabric["status"]),
            int(fabric["healthMask"]),
        )
    )
    profiles = {p.id: p for p in gpu.product.profiles}
    instances: dict[int, GpuInstance] = {}
    for gi_row in row["gpuInstances"]:
        gi_id, profile = int(gi_row["id"]), profiles[int(gi_row["profileId"])]
        start = int(gi_row["placement"]["start"])
        gi = gpu.gpu_instances.get(gi_id)
        if gi is None or gi.profile.id != profile.id or gi.start != start:
            gi = GpuInstance(gpu, gi_id, profile, start)
        cis: dict[int, ComputeInstance] = {}
        for ci_row in gi_row["computeInstances"]:
            ci_id, uuid = int(ci_row["id"]), str(ci_row["uuid"])
            ci = gi.compute_instances.get(ci_id)
            if ci is None or ci.uuid != uuid:
                ci = ComputeInstance(gi, ci_id, gi.ci_profile(int(ci_row["profileId"])), int(ci_row["start"]), uuid)
            cis[ci_id] = ci
        gi.compute_instances = cis
        instances[gi_id] = gi
    gpu.gpu_instances = instances
    gpu.processes = [
        Process(
            int(p["pid"]),
            int(p["usedBytes"]),
            int(p["gpuInstanceId"]),
            int(p["computeInstanceId"]),
            str(p.get("name", "")),
            bool(p.get("tracked", False)),
        )
        for p in row["processes"]
    ]
