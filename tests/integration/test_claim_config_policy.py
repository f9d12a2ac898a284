"""The claim config policy of daemonset/base (claim-config-policy.yaml), on the fake and on upstream's
kube-apiserver, through `kubectl apply`: every opaque config the node refuses at prepare (the unit tests'
BAD_CONFIGS) is refused at create, in claims and in templates, with the node's own words; the examples' and
NVIDIA-style configs pass. Tried before the policy: each of these claims was created, and its pod then stayed in
ContainerCreating with the error in the kubelet's events only."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.claimconfig.config import ConfigError, parse_config
from tests.integration.conftest import Cluster, kubectl, needs_kubectl
from tests.unit.test_claims_config import BAD_CONFIGS
from tests.unit.test_claims_support import API_VERSION, DRIVER

pytestmark = needs_kubectl
DAEMONSET = Path(__file__).resolve().parents[2] / "daemonset"
POLICY = DAEMONSET / "base" / "claim-config-policy.yaml"

# As NVIDIA's quickstart writes them (gpu-test-mps, gpu-test5's two requests, a MIG device shared by MPS).
NVIDIA_STYLE: list[dict[str, Any]] = [
    {"apiVersion": API_VERSION, "kind": "GpuConfig"},
    {"apiVersion": API_VERSION, "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}},
    {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
    },
    {
        "apiVersion": API_VERSION,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {
                "defaultActiveThreadPercentage": 50,
                "defaultPinnedDeviceMemoryLimit": "10Gi",
                "defaultPerDevicePinnedMemoryLimit": {"0": "5Gi", "GPU-1a": 1024},
            },
        },
    },
    {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}},
    {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", "sharing": {"strategy": "TimeSlicing"}},
]


def claim(name: str, parameters: Any, template: bool = False) -> dict[str, Any]:
    spec = {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}],
        }
    }
    if template:
        return {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"spec": spec},
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def node_says(parameters: Any) -> str:
    """The node's words for this config, without the parser's reason in parentheses for a bad quantity."""
    with pytest.raises(ConfigError) as refused:
        parse_config(parameters)
    words = str(refused.value)
    return words.split(" (", 1)[0] if "is not a quantity" in words else words


def apply(config: Path, documents: list[dict[str, Any]], *extra: str) -> subprocess.CompletedProcess[str]:
    return kubectl(config, "apply", *extra, "-f", "-", stdin=yaml.safe_dump_all(documents))


@pytest.fixture
def kubeconfig(cluster: Cluster, tmp_path: Path) -> Any:
    config = cluster.write_kubeconfig(tmp_path / "kubeconfig")
    installed = kubectl(config, "apply", "-f", str(POLICY))
    assert installed.returncode == 0, installed.stderr
    # kube-apiserver applies a new policy once its informer has it: wait until a bad claim is refused.
    deadline = time.monotonic() + 30
    while apply(config, [claim("probe", {"kind": "GpuConfig"})], "--dry-run=server").returncode == 0:
        assert time.monotonic() < deadline, "the claim config policy is not in force after 30s"
        time.sleep(0.3)
    try:
        yield config
    finally:  # the real control plane is shared: the policy must not reach the next test
        kubectl(config, "delete", "-f", str(POLICY), "--ignore-not-found")


def refusals(stderr: str) -> dict[str, str]:
    """kubectl's error line for each object it could not create, by the object's name."""
    out = {}
    for line in stderr.splitlines():
        for kind in ("resourceclaims", "resourceclaimtemplates"):
            marker = f'{kind}.resource.k8s.io "'
            if marker in line:
                name = line.split(marker, 1)[1].split('"', 1)[0]
                out[f"{kind}/{name}"] = line
    return out


@pytest.mark.parametrize("template", [False, True], ids=["claim", "template"])
def test_each_config_the_node_refuses_is_refused_at_create_with_its_words(kubeconfig: Path, template: bool) -> None:
    kind = "resourceclaimtemplates" if template else "resourceclaims"
    bad = {f"bad-{i}": params for i, (params, _) in enumerate(BAD_CONFIGS) if isinstance(params, dict)}
    done = apply(kubeconfig, [claim(name, params, template) for name, params in bad.items()])
    assert "created" not in done.stdout, done.stdout
    said = refusals(done.stderr)
    for name, params in bad.items():
        line = said.get(f"{kind}/{name}", "")
        assert "ValidatingAdmissionPolicy 'gpu-dra-agent-claim-configs'" in line, (params, done.stderr)
        assert f"denied request: {node_says(params)}" in line, (params, line)


def test_good_configs_pass(kubeconfig: Path) -> None:
    examples = [
        d
        for p in sorted((DAEMONSET / "examples").glob("*.yaml"))
        for d in yaml.safe_load_all(p.read_text())
        if d and d["kind"] in ("ResourceClaim", "ResourceClaimTemplate")
    ]
    assert any("config" in d["spec"]["spec"]["devices"] for d in examples)  # the examples do have configs
    for i, params in enumerate(NVIDIA_STYLE):
        parse_config(params)  # the node takes each
        examples += [claim(f"nvidia-{i}", params), claim(f"nvidia-{i}", params, template=True)]
    other_driver = claim("other-driver", {"anything": "goes"})
    other_driver["spec"]["devices"]["config"][0]["opaque"]["driver"] = "example.com"
    examples.append(other_driver)
    done = apply(kubeconfig, examples, "--dry-run=server")
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("created (server dry run)") == len(examples), done.stdout
