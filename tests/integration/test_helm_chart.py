"""The Helm chart (deployments/helm/gpu-dra-agent) and the kustomize tree never drift: `helm template` with
the values that match an overlay renders the same objects as `kubectl kustomize` of that overlay (and of the
base), compared parsed and normalised (lists of named things in name order). `helm lint` is clean; the values
NVIDIA's chart also has (nvidiaDriverRoot, image.*, kubeletPlugin.*, namespaceOverride, controller.*) change what
they say; values the chart cannot honour together are refused. helm v4.3.1 is built from tests/helm/go.mod.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.controlplane import build as cp
from tests.helm import build as helm_build

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deployments" / "helm" / "gpu-dra-agent"
NS = "gpu-dra-agent"
MATCH_BASE = ["--namespace", NS, "--set", "createNamespace=true"]

pytestmark = pytest.mark.timeout(1500)


@pytest.fixture(scope="module")
def helm() -> str:
    if cp.go_command() is None:
        pytest.skip(f"`go` is not on PATH to build helm {helm_build.version()}")
    try:
        return str(helm_build.build(budget_s=1200))
    except cp.BuildTimeout as error:
        pytest.skip(f"helm: {error}")


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def _normalised(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _normalised(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_normalised(v) for v in value]
        if items and all(isinstance(v, dict) and "name" in v for v in items):
            return sorted(items, key=lambda v: str(v["name"]))
        return items
    if isinstance(value, str):
        # kubectl kustomize re-emits a folded (>-) scalar's more-indented lines with a blank line between them
        # (CEL means the same either way); whitespace is all it changes
        return " ".join(value.split())
    return value


def _objects(text: str) -> dict[tuple[str, str, str], Any]:
    objects = {}
    for doc in yaml.safe_load_all(text):
        if doc:
            meta = doc["metadata"]
            objects[(doc["kind"], meta.get("namespace", ""), meta["name"])] = _normalised(doc)
    return objects


def _template(helm: str, *args: str) -> dict[tuple[str, str, str], Any]:
    return _objects(_run(helm, "template", "gpu-dra-agent", str(CHART), *args))


def _kustomize(path: str) -> dict[tuple[str, str, str], Any]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    return _objects(_run(kubectl, "kustomize", str(REPO / path)))


def _assert_same(helm_objects: dict[Any, Any], kustomize_objects: dict[Any, Any]) -> None:
    assert sorted(helm_objects) == sorted(kustomize_objects)
    for key, obj in kustomize_objects.items():
        assert helm_objects[key] == obj, key


def test_helm_lint_is_clean(helm: str) -> None:
    out = _run(helm, "lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize("path", ["daemonset", "daemonset/base"])
def test_the_chart_renders_the_base(helm: str, path: str) -> None:
    _assert_same(_template(helm, "--no-hooks", *MATCH_BASE), _kustomize(path))


@pytest.mark.parametrize(
    ("overlay", "values"),
    [
        ("arbiter", ["--set", "arbiter.enabled=true"]),
        ("consumable-shares", ["--set", "consumableShares=memory"]),
        ("partitionable-devices", ["--set", "partitionableDevices=true"]),
        ("compute-domains", ["--set", "resources.computeDomains.enabled=true"]),
        (
            "compute-domains-only",
            ["--set", "resources.gpus.enabled=false", "--set", "resources.computeDomains.enabled=true"],
        ),
    ],
)
def test_the_chart_renders_each_overlay(helm: str, overlay: str, values: list[str]) -> None:
    # the chart's hooks aside (the controllers' uninstall Jobs, below), which kustomize has no place for
    _assert_same(_template(helm, "--no-hooks", *MATCH_BASE, *values), _kustomize(f"daemonset/overlays/{overlay}"))


def test_the_chart_renders_the_custom_mig_config_overlay(helm: str, tmp_path: Path) -> None:
    kustomized = _kustomize("daemonset/overlays/custom-mig-config")
    configs = kustomized[("ConfigMap", NS, "gpu-dra-agent-mig-parted-config")]["data"]["config.yaml"]
    (tmp_path / "mig.yaml").write_text(configs)
    _assert_same(_template(helm, *MATCH_BASE, "--set-file", f"migConfig={tmp_path / 'mig.yaml'}"), kustomized)


def test_values_named_as_nvidias_chart_change_what_they_say(helm: str) -> None:
    objects = _template(
        helm,
        "--namespace",
        "default",
        "--set",
        "namespaceOverride=gpus",
        "--set",
        "nvidiaDriverRoot=/run/nvidia/driver",
        "--set",
        "image.repository=registry.example/agent",
        "--set",
        "image.tag=1.2.3",
        "--set",
        "kubeletPlugin.nodeSelector.gpu=yes",
        "--set",
        "arbiter.enabled=true",
        "--set",
        "apiServer.host=127.0.0.1",
        "--set",
        "apiServer.port=6443",
    )
    assert ("Namespace", "", "gpu-dra-agent") not in objects  # helm install --create-namespace makes it
    daemonset = objects[("DaemonSet", "gpus", "gpu-dra-agent-node")]
    pod = daemonset["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["image"] == "registry.example/agent:1.2.3"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true", "gpu": "yes"}
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NVIDIA_HOST_DRIVER_ROOT"] == "/run/nvidia/driver"
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
    assert env["ARBITER_USER"] == "system:serviceaccount:gpus:gpu-dra-agent-arbiter"  # whom reservations trust
    (root,) = [v for v in pod["volumes"] if v["name"] == "driver-root"]
    assert root["hostPath"]["path"] == "/run/nvidia/driver"
    (arbiter,) = objects[("Deployment", "gpus", "gpu-dra-agent-arbiter")]["spec"]["template"]["spec"]["containers"]
    assert arbiter["image"] == "registry.example/agent:1.2.3"
    assert {e["name"]: e.get("value") for e in arbiter["env"]}["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    binding = objects[("ClusterRoleBinding", "", "gpu-dra-agent-node")]
    assert {s["namespace"] for s in binding["subjects"]} == {"gpus"}
    policies = [o for k, o in objects.items() if k[0] == "ValidatingAdmissionPolicy"]
    assert "system:serviceaccount:gpu-dra-agent:" not in yaml.safe_dump(policies)
    assert "system:serviceaccount:gpus:gpu-dra-agent-node" in yaml.safe_dump(policies)


@pytest.mark.parametrize(
    ("component", "command", "values", "resources"),
    [
        ("arbiter", "arbiter", ["arbiter.enabled=true", "arbiter.hostNetwork=true"], "devicetaintrules"),
        (
            "compute-domains",
            "compute-domain-controller",
            ["resources.computeDomains.enabled=true", "controller.hostNetwork=true"],
            "computedomains",
        ),
    ],
)
def test_helm_uninstall_runs_each_controllers_uninstall_first(
    helm: str, component: str, command: str, values: list[str], resources: str
) -> None:
    """A pre-delete hook Job per leader-elected controller installed, `gpu-dra-agent <controller> --uninstall`,
    with an account allowed just that, on the controller's network (the test on the real node:
    test_deployed.py); no hook without the controller."""
    name = f"gpu-dra-agent-{component}-uninstall"
    assert not [k for k in _template(helm, *MATCH_BASE) if "uninstall" in k[2]]
    objects = _template(helm, *MATCH_BASE, *(a for v in values for a in ("--set", v)))
    assert [k[2] for k in objects if k[0] == "Job"] == [name]
    job = objects[("Job", NS, name)]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["gpu-dra-agent", command, "--uninstall"]
    assert pod["hostNetwork"] is True and pod["serviceAccountName"] == name
    role = objects[("ClusterRole", "", name)]
    assert {"leases"} in [set(r["resources"]) for r in role["rules"]]
    assert {resources} in [set(r["resources"]) for r in role["rules"]]
    for kind in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding"):  # made before the Job, gone with it
        made = objects[(kind, NS if kind == "ServiceAccount" else "", name)]
        assert made["metadata"]["annotations"]["helm.sh/hook-weight"] == "-10"


def test_arbiter_metrics_port_0_turns_its_metrics_endpoint_off(helm: str) -> None:
    """Tried: two replicas on the node's network both bound :9401 when the chart set METRICS_ADDR empty, which
    the agent's options read as unset (the default)."""
    objects = _template(helm, *MATCH_BASE, "--set", "arbiter.enabled=true", "--set", "arbiter.metricsPort=0")
    (arbiter,) = objects[("Deployment", NS, "gpu-dra-agent-arbiter")]["spec"]["template"]["spec"]["containers"]
    assert arbiter["command"][-1] == "--metrics-addr=" and "ports" not in arbiter
    assert "METRICS_ADDR" not in {e["name"] for e in arbiter["env"]}


def test_compute_domains_take_the_image_namespace_and_controller_values(helm: str) -> None:
    """Tried: resources.computeDomains.enabled with the values an operator changes (namespace, image, API server,
    NVIDIA's controller.* names): the controller's Deployment and both accounts follow them like the rest."""
    objects = _template(
        helm,
        "--namespace",
        "gpus",
        "--set",
        "resources.computeDomains.enabled=true",
        "--set",
        "image.repository=registry.example/agent",
        "--set",
        "image.tag=1.2.3",
        "--set",
        "apiServer.host=127.0.0.1",
        "--set",
        "controller.nodeSelector.role=control",
        "--set",
        "controller.hostNetwork=true",
        "--set",
        "controller.replicas=1",
        "--set",
        "controller.containers.computeDomain.resources.limits.memory=1Gi",
    )
    assert ("CustomResourceDefinition", "", "computedomains.resource.nvidia.com") in objects
    assert {k[2] for k in objects if k[0] == "DeviceClass"} >= {
        "compute-domain-daemon.nvidia.com",
        "compute-domain-default-channel.nvidia.com",
    }
    deployment = objects[("Deployment", "gpus", "gpu-dra-agent-compute-domains")]
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"role": "control"} and pod["hostNetwork"] is True
    (controller,) = pod["containers"]
    assert controller["image"] == "registry.example/agent:1.2.3"
    assert controller["resources"] == {"limits": {"memory": "1Gi"}}
    assert {e["name"]: e.get("value") for e in controller["env"]}["KUBERNETES_SERVICE_HOST"] == "127.0.0.1"
    for binding in ("gpu-dra-agent-compute-domains", "gpu-dra-agent-node-compute-domains"):
        assert {s["namespace"] for s in objects[("ClusterRoleBinding", "", binding)]["subjects"]} == {"gpus"}
    assert ("RoleBinding", "gpus", "gpu-dra-agent-compute-domains-leader") in objects
    (agent,) = objects[("DaemonSet", "gpus", "gpu-dra-agent-node")]["spec"]["template"]["spec"]["containers"]
    assert {"COMPUTE_DOMAINS", "POD_IP"} <= {e["name"] for e in agent["env"]}
    # off (the default): none of it
    off = _template(helm, "--namespace", "gpus")
    assert not [k for k in off if "compute-domain" in k[2]]
    assert "COMPUTE_DOMAINS" not in yaml.safe_dump(off)


def test_compute_domains_alone_install_the_node_agent_without_its_gpu_driver(helm: str) -> None:
    """Tried: NVIDIA's ComputeDomains-only install (resources.gpus.enabled=false with computeDomains on) into
    another namespace: the node DaemonSet with GPUS=false and no MIG configs, the ComputeDomain CRD, controller
    and device classes, the node RBAC the compute-domain driver uses; no GPU or MIG device class, no policy on
    GPU claim configs, no MIG ConfigMap, no arbiter Lease role."""
    objects = _template(
        helm,
        "--namespace",
        "gpus",
        "--set",
        "resources.gpus.enabled=false",
        "--set",
        "resources.computeDomains.enabled=true",
    )
    assert {k[2] for k in objects if k[0] == "DeviceClass"} == {
        "compute-domain-daemon.nvidia.com",
        "compute-domain-default-channel.nvidia.com",
    }
    for gone in (
        ("ValidatingAdmissionPolicy", "", "gpu-dra-agent-claim-configs"),
        ("ConfigMap", "gpus", "gpu-dra-agent-mig-parted-config"),
        ("Role", "gpus", "gpu-dra-agent-node-leases"),
    ):
        assert gone not in objects, gone
    for kept in (
        ("CustomResourceDefinition", "", "computedomains.resource.nvidia.com"),
        ("Deployment", "gpus", "gpu-dra-agent-compute-domains"),
        ("ClusterRoleBinding", "", "gpu-dra-agent-node"),
        ("ClusterRoleBinding", "", "gpu-dra-agent-node-compute-domains"),
        ("ValidatingAdmissionPolicy", "", "gpu-dra-agent-own-node-slices"),
    ):
        assert kept in objects, kept
    pod = objects[("DaemonSet", "gpus", "gpu-dra-agent-node")]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["GPUS"] == "false" and env["COMPUTE_DOMAINS"] == "true" and "MIG_CONFIG_FILE" not in env
    assert "mig-parted-config" not in {v["name"] for v in pod["volumes"]}
    assert "mig-parted-config" not in {m["name"] for m in agent["volumeMounts"]}
    # the default install keeps its GPU driver
    (default_agent,) = _template(helm)[("DaemonSet", "default", "gpu-dra-agent-node")]["spec"]["template"]["spec"][
        "containers"
    ]
    assert "GPUS" not in {e["name"] for e in default_agent["env"]}


def test_values_the_chart_cannot_honour_together_are_refused(helm: str) -> None:
    """Tried: neither driver on, the arbiter or GPU-driver settings with the GPU driver off, and the two agent
    modes that exclude each other: helm says which, before anything is installed."""
    refused = {
        "resources.gpus.enabled and resources.computeDomains.enabled are both false": [
            "resources.gpus.enabled=false",
        ],
        "arbiter.enabled needs resources.gpus.enabled": [
            "resources.gpus.enabled=false",
            "resources.computeDomains.enabled=true",
            "arbiter.enabled=true",
        ],
        "consumableShares and partitionableDevices configure the GPU driver": [
            "resources.gpus.enabled=false",
            "resources.computeDomains.enabled=true",
            "partitionableDevices=true",
        ],
        "consumableShares and partitionableDevices cannot be combined": [
            "consumableShares=memory",
            "partitionableDevices=true",
        ],
    }
    for message, values in refused.items():
        sets = [arg for value in values for arg in ("--set", value)]
        done = subprocess.run(
            [helm, "template", "x", str(CHART), *sets], capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode != 0 and message in done.stderr, (values, done.stderr)
