"""`kubectl label node N nvidia.com/mig.config=<name>` against the real daemon, the API fake and fake GPUs
that keep their state in a file (FAKE_NVML_STATE): what an operator sees (the state label, Events, the
devices in the ResourceSlices) and what the GPUs end up as, including after a kill -9 in the middle."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client

import fakes.apiserver
from agent.claims.types import ClaimRef
from fakes.kubelet import FakeKubelet
from tests.integration.test_node_support import (
    DRIVER,
    NODE,
    Daemon,
    agent_command,
    allocate_claim,
    clean_env,
    create_node,
    short_tmpdir,
)

STATE = "nvidia.com/mig.config.state"
H100_GPUS = 8


class MigNode:
    def __init__(
        self,
        server: fakes.apiserver.ApiServer,
        daemon: Daemon,
        kubelet: FakeKubelet,
        kubeconfig: pathlib.Path,
        gpu_state: pathlib.Path,
    ) -> None:
        self.server = server
        self.api = server.api_client()
        self.daemon = daemon
        self.kubelet = kubelet
        self.kubeconfig = kubeconfig
        self.gpu_state = gpu_state

    def label(self, value: str) -> None:
        """What the operator types; through the Python client when kubectl is not installed."""
        kubectl = shutil.which("kubectl")
        if kubectl is None:
            body = {"metadata": {"labels": {"nvidia.com/mig.config": value}}}
            client.CoreV1Api(self.api).patch_node(NODE, body)
            return
        done = subprocess.run(
            [
                kubectl,
                "--kubeconfig",
                str(self.kubeconfig),
                "label",
                "node",
                NODE,
                f"nvidia.com/mig.config={value}",
                "--overwrite",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 0, done.stderr

    def relabel(self, value: str, end: str = "success", timeout: float = 30.0) -> None:
        """Label, and wait until the agent has carried this value to `end` (an Event marks each end)."""
        done = len(self.ends())
        self.label(value)
        wait_for(
            lambda: len(self.ends()) > done and self.labels().get(STATE) == end,
            f"{value} -> {end}",
            timeout,
            self.daemon,
        )

    def release(self, *refs: ClaimRef) -> None:
        """Delete the claims, as the resourceclaim controller does once their pods are gone."""
        for ref in refs:
            client.ResourceV1Api(self.api).delete_namespaced_resource_claim(ref.name, ref.namespace)

    def ends(self) -> list[dict[str, Any]]:
        return [e for r in ("MigConfigApplied", "MigConfigFailed", "MigConfigRebooting") for e in self.events(r)]

    def labels(self) -> dict[str, str]:
        node = self.server.store.get("Node", NODE)
        assert node is not None
        return dict(node["metadata"].get("labels") or {})

    def wait_state(self, want: str, timeout: float = 30.0) -> None:
        wait_for(lambda: self.labels().get(STATE) == want, f"{STATE}={want}", timeout, self.daemon)

    def devices(self) -> list[dict[str, Any]]:
        return [d for s in self.server.store.objects("ResourceSlice") for d in s["spec"].get("devices", [])]

    def profiles(self) -> Counter[str]:
        """What the slices offer: MIG profiles, and `gpu` for whole GPUs."""
        out: Counter[str] = Counter()
        for d in self.devices():
            attrs = d.get("attributes", {})
            out[attrs["profile"]["string"] if "profile" in attrs else "gpu"] += 1
        return out

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.server.store.objects("Event")
            if e["reason"] == reason and e["involvedObject"]["name"] == NODE
        ]

    def gpus(self) -> list[dict[str, Any]]:
        """The fake GPUs as the state file holds them (what survives the agent)."""
        return json.loads(self.gpu_state.read_text())["gpus"]  # type: ignore[no-any-return]


def wait_for(cond: Callable[[], bool], what: str, timeout: float, daemon: Daemon) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {timeout}s; agent log:\n{daemon.tail()}")


def instances(gpus: list[dict[str, Any]]) -> Counter[str]:
    return Counter(gi["profile"] for g in gpus for gi in g["gpuInstances"])


@pytest.fixture(scope="module")
def node() -> Iterator[MigNode]:
    with short_tmpdir("mig-") as root, fakes.apiserver.start(port=0) as server:
        create_node(server.api_client())
        kubeconfig = server.write_kubeconfig(root / "kubeconfig")
        gpu_state = root / "gpus.json"
        daemon = Daemon(root, kubeconfig, env={"FAKE_NVML_STATE": str(gpu_state)})
        daemon.start()
        try:
            daemon.wait_serving()
            with FakeKubelet(daemon.kubelet_root) as kubelet:
                kubelet.wait_for_driver(DRIVER)
                yield MigNode(server, daemon, kubelet, kubeconfig, gpu_state)
        finally:
            daemon.close()


def test_kubectl_label_all_1g10gb_ends_in_success_with_56_devices(node: MigNode) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: this test is about what `kubectl label node` does")
    assert node.profiles() == Counter({"gpu": H100_GPUS})
    node.relabel("all-1g.10gb", "success")
    assert node.profiles() == Counter({"1g.10gb": 56})
    assert instances(node.gpus()) == Counter({"1g.10gb": 56})
    [applied] = node.events("MigConfigApplied")[-1:]
    assert applied["type"] == "Normal" and "all-1g.10gb" in applied["message"]


def test_all_balanced_then_all_disabled_follow(node: MigNode) -> None:
    node.relabel("all-balanced", "success")
    assert node.profiles() == Counter({"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8})
    node.relabel("all-disabled", "success")
    assert node.profiles() == Counter({"gpu": H100_GPUS})
    assert all(g["migMode"] == {"current": 0, "pending": 0} and not g["gpuInstances"] for g in node.gpus())


def test_unknown_name_ends_in_failed_with_nothing_changed(node: MigNode) -> None:
    node.relabel("all-balanced", "success")
    before_devices, before_gpus = sorted(d["name"] for d in node.devices()), node.gpus()
    node.relabel("all-3g.999gb", "failed")
    [failed] = node.events("MigConfigFailed")[-1:]
    assert failed["type"] == "Warning"
    assert failed["message"].startswith("unknown MIG config 'all-3g.999gb'")
    assert sorted(d["name"] for d in node.devices()) == before_devices
    assert node.gpus() == before_gpus


def test_pending_while_a_claim_is_prepared_then_applied(node: MigNode) -> None:
    node.relabel("all-disabled", "success")
    ref = allocate_claim(node.api, "holds-gpu-2", ["gpu-2"])
    assert node.kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""
    try:
        node.label("all-7g.80gb")
        node.wait_state("pending")
        wait_for(lambda: bool(node.events("MigConfigWaiting")), "a MigConfigWaiting Event", 10, node.daemon)
        [waiting] = node.events("MigConfigWaiting")[-1:]
        assert "default/holds-gpu-2" in waiting["message"]
        # Withdrawn from the slices at once, yet not touched while the claim is prepared.
        wait_for(lambda: not node.devices(), "the GPUs withdrawn from the slices", 10, node.daemon)
        time.sleep(0.5)
        assert node.labels()[STATE] == "pending"
        assert all(g["migMode"]["current"] == 0 for g in node.gpus())
        # Nothing new lands on them: prepare refuses a GPU being reconfigured.
        other = allocate_claim(node.api, "late", ["gpu-5"])
        assert node.kubelet.prepare(DRIVER, [other])[other.uid].error != ""
    finally:
        assert node.kubelet.unprepare(DRIVER, [ref]) == {ref.uid: ""}
        node.release(ref, other)
    node.wait_state("success")
    assert node.profiles() == Counter({"7g.80gb": H100_GPUS})


def test_kill_9_in_the_middle_of_an_apply_converges_after_restart(node: MigNode) -> None:
    """Killed while the GPUs are half-way (some instances made, maybe a GPU instance without its compute
    instance), the restarted agent reaches exactly the label's layout: nothing leaked, nothing missing."""
    for value, want in [
        ("all-1g.10gb", Counter({"1g.10gb": 56})),
        ("all-balanced", Counter({"1g.10gb": 16, "2g.20gb": 8, "3g.40gb": 8})),
    ]:
        before = instances(node.gpus())
        node.label(value)
        wait_for(
            lambda b=before, w=want: instances(node.gpus()) not in (b, w), "a half-applied layout", 30, node.daemon
        )
        node.daemon.kill()
        half = node.gpus()
        assert instances(half) != want  # really killed half-way
        node.daemon.start()
        node.daemon.wait_serving()
        node.wait_state("success")
        gpus = node.gpus()
        assert instances(gpus) == want
        for g in gpus:
            assert g["migMode"] == {"current": 1, "pending": 1}
            for gi in g["gpuInstances"]:
                assert len(gi["computeInstances"]) == 1, f"GPU {g['uuid']} GI {gi['id']}: {gi}"
        assert node.profiles() == want


def test_a_restarted_agent_keeps_pending_gpus_out_of_its_first_publish(node: MigNode) -> None:
    """Killed while waiting for a claim: the new process withholds the changing GPUs from its very first
    publish, then finishes once the claim is gone."""
    node.relabel("all-disabled", "success")
    ref = allocate_claim(node.api, "survives-restart", ["gpu-0"])
    assert node.kubelet.prepare(DRIVER, [ref])[ref.uid].error == ""
    node.label("all-1g.10gb")
    node.wait_state("pending")
    node.daemon.kill()
    node.daemon.start()
    node.daemon.wait_serving()
    assert node.devices() == []  # nothing of the 8 changing GPUs was offered in between
    assert node.labels()[STATE] == "pending"
    # The kubelet re-registers with the new process before it unprepares.
    node.kubelet.wait_for_driver(DRIVER)
    assert node.kubelet.unprepare(DRIVER, [ClaimRef(ref.namespace, ref.uid, ref.name)]) == {ref.uid: ""}
    node.release(ref)
    node.wait_state("success")
    assert node.profiles() == Counter({"1g.10gb": 56})


def test_an_allocated_claim_not_yet_prepared_holds_the_relabel_until_released(node: MigNode) -> None:
    """The arbiter (or the scheduler) placed a claim on GPU 4 and its pod is bound, but the kubelet has not
    prepared it yet: the relabel waits in `pending`, names the claim, withdraws the GPUs and touches none of
    them until the claim is released; then it applies."""
    node.relabel("all-disabled", "success")
    ref = allocate_claim(node.api, "placed-not-prepared", ["gpu-4"])
    try:
        node.label("all-1g.10gb")
        node.wait_state("pending")
        wait_for(
            lambda: any("default/placed-not-prepared" in e["message"] for e in node.events("MigConfigWaiting")),
            "a MigConfigWaiting Event naming the claim",
            10,
            node.daemon,
        )
        wait_for(lambda: not node.devices(), "the GPUs withdrawn from the slices", 10, node.daemon)
        time.sleep(1.5)  # more than a poll of the claims
        assert node.labels()[STATE] == "pending"
        assert all(g["migMode"]["current"] == 0 and not g["gpuInstances"] for g in node.gpus())
    finally:
        node.release(ref)
    node.wait_state("success")
    assert node.profiles() == Counter({"1g.10gb": 56})


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (None, "cannot be read: No such file or directory"),
        (
            "version: v1\nmig-configs:\n  mine:\n    - devices: all\n      mig-enabled: maybe\n",
            "config 'mine' entry 0: mig-enabled must be true or false",
        ),
    ],
    ids=["missing", "invalid"],
)
def test_an_invalid_mig_config_file_stops_the_agent_with_one_sentence(
    tmp_path: pathlib.Path, content: str | None, says: str
) -> None:
    # tried: --mig-config-file naming a file that is absent, and one mig-parted would refuse
    path = tmp_path / "configs.yaml"
    if content is not None:
        path.write_text(content)
    done = subprocess.run(
        agent_command(
            "--node-name",
            NODE,
            "--nvml",
            "fake:dgx-h100",
            "--state-dir",
            str(tmp_path / "state"),
            "--mig-config-file",
            str(path),
        ),
        check=False,
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # one sentence, no traceback
    # the fatal line is a log record
    assert f"CRITICAL agent.node: gpu-dra-agent node: --mig-config-file {path}" in lines[0]
    assert says in lines[0]
