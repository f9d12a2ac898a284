"""A GPU's multi-node NVLink fabric breaks mid-job (issue 36, item 5): the node agent on the fake GB200 NVL72
taints the GPU in its ResourceSlice (`gpu.nvidia.com/fabric`, NoSchedule, the fault as value), the kubelet's
health stream reports it Unhealthy, and both clear when the fabric recovers. A GPU without a fabric (H100 NVL,
PCIe) never gets the taint. In-process agent, API fake (1.37, which serves device taints), kubelet fake."""

from __future__ import annotations

from collections.abc import Iterator

import pynvml as N
import pytest

from agent.kubelet.health import Health
from tests.integration.test_node_health import Node, health_of, next_until, start_node, taints_of
from tests.integration.test_node_support import DRIVER, allocate_claim, eventually

FABRIC = "gpu.nvidia.com/fabric"


@pytest.fixture
def nvl72() -> Iterator[Node]:
    yield from start_node("gb200-nvl72-node00", "1.37")()


@pytest.fixture
def h100_pcie() -> Iterator[Node]:
    yield from start_node("h100-nvl-x4", "1.37")()


def fabric_taint(node: Node, device: str) -> tuple[str, str] | None:
    found = [(t["value"], t["effect"]) for t in taints_of(node, device) if t["key"] == FABRIC]
    return found[0] if found else None


def test_a_fabric_broken_mid_job_taints_the_gpu_and_reports_it_unhealthy_until_it_recovers(nvl72: Node) -> None:
    """Tried: a claim prepared on gpu-0 (the job), then the fabric manager drops gpu-0's registration
    (NOT_STARTED) and gpu-1's bandwidth degrades; then both recover."""
    node = nvl72
    job = allocate_claim(node.api, "job", ["gpu-0"])
    assert node.kubelet.prepare(DRIVER, [job])[job.uid].error == ""
    assert all(fabric_taint(node, f"gpu-{i}") is None for i in range(4))
    watch = node.kubelet.watch_health(DRIVER, timeout=30)
    try:
        assert {d.health for d in next(watch)} == {Health.HEALTHY}

        node.nvml.fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
        node.nvml.fake.set_fabric(1, degraded=True)
        eventually(lambda: fabric_taint(node, "gpu-1") is not None, "gpu-0 and gpu-1 tainted")
        assert fabric_taint(node, "gpu-0") == ("not-started", "NoSchedule")
        assert fabric_taint(node, "gpu-1") == ("degraded-bandwidth", "NoSchedule")
        assert fabric_taint(node, "gpu-2") is None and fabric_taint(node, "gpu-3") is None
        devices = next_until(watch, lambda ds: health_of(ds, "gpu-1") is Health.UNHEALTHY)
        assert {d.device for d in devices if d.health is Health.UNHEALTHY} == {"gpu-0", "gpu-1"}
        # why, as the v1 stream's `message` carries it (the kubelet fake speaks the older version here)
        recorded = node.agent.health.snapshot().devices
        assert {d.device: d.message for d in recorded if d.health is Health.UNHEALTHY} == {
            "gpu-0": "NVLink fabric not-started",
            "gpu-1": "NVLink fabric degraded-bandwidth",
        }
        # the running job keeps its GPUs (NoSchedule evicts nothing); a new claim on them is refused
        late = allocate_claim(node.api, "late", ["gpu-1"])
        assert "gpu-1 is unhealthy" in node.kubelet.prepare(DRIVER, [late])[late.uid].error

        node.nvml.fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_COMPLETED)
        node.nvml.fake.set_fabric(1, degraded=False)
        eventually(lambda: all(fabric_taint(node, f"gpu-{i}") is None for i in range(4)), "the taints cleared")
        devices = next_until(watch, lambda ds: all(d.health is Health.HEALTHY for d in ds))
        assert len(devices) == 4
    finally:
        watch.cancel()
    assert node.kubelet.prepare(DRIVER, [late])[late.uid].error == ""


def test_a_failed_registration_taints_as_failed(nvl72: Node) -> None:
    """Tried: registration COMPLETED with an error status on gpu-2."""
    node = nvl72
    node.nvml.fake.set_fabric(2, status=N.NVML_ERROR_UNKNOWN)
    eventually(lambda: fabric_taint(node, "gpu-2") == ("failed", "NoSchedule"), "gpu-2 tainted as failed")
    assert health_of(node.agent.health.snapshot().devices, "gpu-2") is Health.UNHEALTHY


def test_a_gpu_without_a_fabric_never_gets_the_fabric_taint(h100_pcie: Node) -> None:
    """Tried: an H100 NVL (PCIe) node, whose NVML says fabric NOT_SUPPORTED, through several resyncs."""
    node = h100_pcie
    with pytest.raises(ValueError, match="no multi-node NVLink fabric"):
        node.nvml.fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
    eventually(lambda: node.published() == {f"gpu-{i}" for i in range(4)}, "the GPUs published")
    assert [g.fabric_fault for g in node.agent.inventory.gpus] == [None] * 4
    assert all(taints_of(node, f"gpu-{i}") == [] for i in range(4))
    assert {d.health for d in node.agent.health.snapshot().devices} == {Health.HEALTHY}
