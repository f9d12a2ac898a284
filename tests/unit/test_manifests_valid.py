"""daemonset/: every manifest is valid for Kubernetes 1.34-1.37, the kustomize base and overlays render, and the
examples select the devices they promise."""

from __future__ import annotations

import itertools
import pathlib
import shutil
import subprocess
from typing import Any

import cel
import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate
import pytest
import yaml

from agent.allocation.cel import DeviceSelector, device_variable
from agent.devices.model import Inventory
from agent.migconfig.spec import parse_mig_configs
from agent.slices.build import build_resource_slices
from tests.unit.test_slices_factory import dgx_h100, h100, mig_device, nvswitch_inventory

DAEMONSET = pathlib.Path(__file__).resolve().parents[2] / "daemonset"
DRIVER = "gpu.nvidia.com"
AGENT_SA = "system:serviceaccount:gpu-dra-agent:gpu-dra-agent-node"
SINCE = {
    ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicy"): "1.36",
    ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicyBinding"): "1.36",
    ("resource.k8s.io/v1", "DeviceTaintRule"): "1.37",
}


def documents(path: pathlib.Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def all_documents() -> list[tuple[str, dict[str, Any]]]:
    files = sorted(DAEMONSET.rglob("*.yaml"))
    return [(str(f.relative_to(DAEMONSET)), d) for f in files for d in documents(f)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [d for _, d in all_documents() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return found


VERSIONS = ("1.34", "1.35", "1.36", "1.37")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("where", "obj"), all_documents(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_manifest_validates_against_the_strict_schema(where: str, obj: dict[str, Any], version: str) -> None:
    # SchemaNotFoundError (a kind the version does not serve) fails the test as well as a schema violation; the
    # arbiter's gate policy is a MutatingAdmissionPolicy, GA from 1.36: checked from the first release with it
    validate_from_its_release(obj, version)


def validate_from_its_release(obj: dict[str, Any], version: str) -> None:
    if obj["apiVersion"].startswith("scheduling.gpu-dra-agent.io/"):  # ours (the default Queue): its CRD's schema
        (crd,) = [
            d
            for _, d in all_documents()
            if d["kind"] == "CustomResourceDefinition" and d["spec"]["names"]["kind"] == obj["kind"]
        ]
        (served,) = [v for v in crd["spec"]["versions"] if obj["apiVersion"].endswith("/" + v["name"])]
        jsonschema.validate(obj, served["schema"]["openAPIV3Schema"])
        return
    since = SINCE.get((obj["apiVersion"], obj["kind"]), "1.34")
    if tuple(map(int, version.split("."))) >= tuple(map(int, since.split("."))):
        kubernetes_validate.validate(obj, version, strict=True)


KUSTOMIZATIONS = sorted(p.parent for p in DAEMONSET.rglob("Kustomization"))


def kustomize(directory: pathlib.Path) -> list[dict[str, Any]]:
    """`kubectl kustomize` (kustomize built into kubectl), as `kubectl apply -k` renders it."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed here")
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# What an overlay leaves out of the base: ComputeDomains alone has no GPU driver, so none of its objects.
DROPPED = {
    "overlays/compute-domains-only": {
        ("DeviceClass", "gpu.nvidia.com"),
        ("DeviceClass", "mig.nvidia.com"),
        ("ValidatingAdmissionPolicy", "gpu-dra-agent-claim-configs"),
        ("ValidatingAdmissionPolicyBinding", "gpu-dra-agent-claim-configs"),
        ("ConfigMap", "gpu-dra-agent-mig-parted-config"),
        ("Role", "gpu-dra-agent-node-leases"),
        ("RoleBinding", "gpu-dra-agent-node-leases"),
    }
}


def base_documents() -> list[dict[str, Any]]:
    return [d for w, d in all_documents() if w.startswith("base/")]


def key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(DAEMONSET)) or "daemonset")
def test_every_kustomization_renders_valid_objects_for_every_version(directory: pathlib.Path) -> None:
    rendered = kustomize(directory)
    dropped = {key(d) for d in base_documents()} - {key(d) for d in rendered}
    assert dropped == DROPPED.get(str(directory.relative_to(DAEMONSET)), set())  # overlays add, or drop on purpose
    for obj in rendered:
        for version in VERSIONS:
            validate_from_its_release(obj, version)


def test_daemonset_directory_installs_the_base_and_overlays_change_one_thing() -> None:
    assert {"base", "overlays/partitionable-devices", "overlays/custom-mig-config", "overlays/arbiter"} <= {
        str(p.relative_to(DAEMONSET)) for p in KUSTOMIZATIONS
    }
    base = kustomize(DAEMONSET)
    assert sorted(map(key, base)) == sorted(map(key, base_documents()))
    assert not any(d["kind"] in ("ResourceClaimTemplate", "Pod") for d in base)  # examples are not installed

    def agent_env(rendered: list[dict[str, Any]]) -> dict[str, Any]:
        (ds,) = [d for d in rendered if d["kind"] == "DaemonSet"]
        (ctr,) = ds["spec"]["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in ctr["env"]}

    partitionable = kustomize(DAEMONSET / "overlays" / "partitionable-devices")
    assert agent_env(partitionable) == {**agent_env(base), "PARTITIONABLE_DEVICES": "true"}
    assert [d for d in partitionable if d["kind"] != "DaemonSet"] == [d for d in base if d["kind"] != "DaemonSet"]
    shared = kustomize(DAEMONSET / "overlays" / "consumable-shares")
    assert agent_env(shared) == {**agent_env(base), "CONSUMABLE_SHARES": "memory"}

    def mig_configs(rendered: list[dict[str, Any]]) -> dict[str, Any]:
        (cm,) = [d for d in rendered if d["kind"] == "ConfigMap"]
        return dict(parse_mig_configs(cm["data"]["config.yaml"], "the ConfigMap").configs)

    custom = kustomize(DAEMONSET / "overlays" / "custom-mig-config")
    assert set(mig_configs(custom)) == {"all-disabled", "inference-mixed"}  # parsed as the agent parses them
    assert "all-1g.10gb" in mig_configs(base)  # the GPU Operator's default
    assert [d for d in custom if d["kind"] != "ConfigMap"] == [d for d in base if d["kind"] != "ConfigMap"]


def test_all_required_objects_are_present() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in all_documents()}
    for required in [
        ("Namespace", "gpu-dra-agent"),
        ("ServiceAccount", "gpu-dra-agent-node"),
        ("ClusterRole", "gpu-dra-agent-node"),
        ("ClusterRoleBinding", "gpu-dra-agent-node"),
        ("ValidatingAdmissionPolicy", "gpu-dra-agent-own-node-slices"),
        ("ValidatingAdmissionPolicyBinding", "gpu-dra-agent-own-node-slices"),
        ("DaemonSet", "gpu-dra-agent-node"),
        ("DeviceClass", "gpu.nvidia.com"),
        ("DeviceClass", "mig.nvidia.com"),
    ]:
        assert required in kinds
    templates = {d["metadata"]["name"] for _, d in all_documents() if d["kind"] == "ResourceClaimTemplate"}
    assert len(templates) == 6
    pods = [d for _, d in all_documents() if d["kind"] == "Pod"]
    with_claims = [p for p in pods if p["spec"].get("resourceClaims")]
    assert {p["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] for p in with_claims} == templates
    (device_plugin_style,) = [p for p in pods if not p["spec"].get("resourceClaims")]
    limits = device_plugin_style["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"nvidia.com/gpu": 1}
    assert one("DeviceClass", "gpu.nvidia.com")["spec"]["extendedResourceName"] == "nvidia.com/gpu"


def test_rbac_is_least_privilege() -> None:
    rules = one("ClusterRole", "gpu-dra-agent-node")["rules"]
    granted = {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert not any("*" in entry for entry in granted)
    for verb in ("create", "update", "patch", "delete", "get", "list", "watch"):
        assert ("resource.k8s.io", "resourceslices", verb) in granted
    assert {v for g, r, v in granted if r == "resourceclaims"} == {"get", "list", "watch"}
    assert {v for g, r, v in granted if r == "nodes"} == {"get", "list", "watch", "patch"}
    assert {v for g, r, v in granted if r == "pods"} == {"get", "list"}
    assert not any(r in ("secrets", "configmaps") for _, r, _ in granted)
    binding = one("ClusterRoleBinding", "gpu-dra-agent-node")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "gpu-dra-agent-node", "namespace": "gpu-dra-agent"}
    ]


def test_daemonset_mounts_probes_and_identity() -> None:
    ds = one("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "gpu-dra-agent-node"
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["nodeSelector"] and pod["tolerations"]
    (ctr,) = pod["containers"]
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {m["mountPath"] for m in ctr["volumeMounts"] if m["name"] in host_paths}
    expected = {"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry", "/var/run/cdi", "/dev"}
    assert set(host_paths.values()) >= expected and mounts >= expected
    env = {e["name"]: e for e in ctr["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["DRIVER_NAME"]["value"] == DRIVER
    assert ctr["livenessProbe"] and ctr["readinessProbe"]
    assert ctr["resources"]["requests"]["cpu"] and ctr["resources"]["limits"]["memory"]
    assert ctr["securityContext"]["privileged"] is True


def test_dockerfile_runs_the_node_agent_with_the_arbiter_core_compiled() -> None:
    text = (DAEMONSET / "Dockerfile").read_text()
    assert "FROM python:3.11-slim AS build" in text and "python native/compile.py" in text
    assert "COPY --from=build /wheels /wheels" in text
    assert "pip install" in text and 'ENTRYPOINT ["gpu-dra-agent", "node"]' in text


# --- the admission policy, evaluated with a real CEL library -------------------------------------------


def admit(
    operation: str,
    *,
    username: str = AGENT_SA,
    token_node: str | None = "node-a",
    new_node: str | None = None,
    old_node: str | None = None,
) -> bool:
    """Run the policy as kube-apiserver would for one request; True when the request is allowed."""
    policy = one("ValidatingAdmissionPolicy", "gpu-dra-agent-own-node-slices")["spec"]
    extra = {"authentication.kubernetes.io/node-name": [token_node]} if token_node else {}
    env: dict[str, Any] = {
        "request": {"operation": operation, "userInfo": {"username": username, "extra": extra}},
        "object": None if new_node is None else {"spec": {"nodeName": new_node}},
        "oldObject": None if old_node is None else {"spec": {"nodeName": old_node}},
    }
    if not all(cel.evaluate(c["expression"], env) for c in policy["matchConditions"]):
        return True
    env["variables"] = {}
    for var in policy["variables"]:
        env["variables"][var["name"]] = cel.evaluate(var["expression"], env)
    return all(cel.evaluate(v["expression"], env) for v in policy["validations"])


def test_admission_policy_lets_the_agent_write_only_its_own_nodes_slices() -> None:
    assert admit("CREATE", new_node="node-a")
    assert admit("UPDATE", new_node="node-a", old_node="node-a")
    assert admit("DELETE", old_node="node-a")
    assert not admit("CREATE", new_node="node-b")  # another node's slice
    assert not admit("UPDATE", new_node="node-a", old_node="node-b")
    assert not admit("DELETE", old_node="node-b")
    assert not admit("CREATE", new_node=None)  # a cluster-wide slice (no nodeName)
    assert not admit("CREATE", token_node=None, new_node="node-a")  # a token not bound to a pod on a node
    assert admit("CREATE", username="system:serviceaccount:kube-system:other", new_node="node-b")  # not ours


# --- example claims against slices built from a DGX H100 ----------------------------------------------


def cel_device(device: dict[str, Any], driver: str = DRIVER) -> dict[str, Any]:
    """A slice device as DRA CEL sees it (the project's DRA CEL environment, as the demo scheduler uses)."""
    return device_variable(driver, device)


def matches(expression: str, device: dict[str, Any]) -> bool:
    return DeviceSelector(expression).matches(cel_device(device))


def candidates(template: str, slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (request,) = one("ResourceClaimTemplate", template)["spec"]["spec"]["devices"]["requests"]
    exactly = request["exactly"]
    selectors = [s["cel"]["expression"] for s in one("DeviceClass", exactly["deviceClassName"])["spec"]["selectors"]]
    selectors += [s["cel"]["expression"] for s in exactly.get("selectors", [])]
    return [d for s in slices for d in s["spec"]["devices"] if all(matches(e, d) for e in selectors)]


@pytest.fixture(scope="module")
def dgx_slices() -> list[dict[str, Any]]:
    """A DGX H100 with GPU 0 in MIG mode (two 1g.10gb and one 3g.40gb) and seven whole GPUs."""
    gpu0 = h100(0, mig_enabled=True)
    migs = (mig_device(gpu0, "1g.10gb", 0, 9), mig_device(gpu0, "1g.10gb", 1, 10), mig_device(gpu0, "3g.40gb", 4, 2))
    inv = nvswitch_inventory([gpu0, *(h100(i) for i in range(1, 8))], migs=migs)
    return build_resource_slices(inv, "node-a")


def names(devices: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for d in devices]


def test_h100_by_product_name_and_40gi_memory_pick_whole_gpus(dgx_slices: list[dict[str, Any]]) -> None:
    whole = [f"gpu-{i}" for i in range(1, 8)]
    assert names(candidates("one-h100-80gb", dgx_slices)) == whole
    assert names(candidates("gpu-40gi", dgx_slices)) == whole
    small = build_resource_slices(nvswitch_inventory([h100(0, memory_bytes=24 * 2**30)]), "node-b")
    assert candidates("gpu-40gi", small) == []  # 24Gi is below 40Gi
    assert (
        candidates(
            "one-h100-80gb",
            build_resource_slices(nvswitch_inventory([h100(0, product_name="NVIDIA H100 NVL")]), "node-c"),
        )
        == []
    )


def test_mig_example_picks_only_1g10gb_devices(dgx_slices: list[dict[str, Any]]) -> None:
    assert names(candidates("mig-1g10gb", dgx_slices)) == ["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1"]


def test_sharing_examples_carry_the_gpu_config(dgx_slices: list[dict[str, Any]]) -> None:
    for template, strategy in (("time-sliced-gpu", "TimeSlicing"), ("mps-shared-gpu", "MPS")):
        spec = one("ResourceClaimTemplate", template)["spec"]["spec"]["devices"]
        (config,) = spec["config"]
        params = config["opaque"]["parameters"]
        assert config["opaque"]["driver"] == DRIVER
        assert (params["apiVersion"], params["kind"]) == ("resource.nvidia.com/v1beta1", "GpuConfig")
        assert params["sharing"]["strategy"] == strategy
        assert len(candidates(template, dgx_slices)) == 7
    mps = one("ResourceClaimTemplate", "mps-shared-gpu")["spec"]["spec"]["devices"]["config"][0]
    assert mps["opaque"]["parameters"]["sharing"]["mpsConfig"] == {
        "defaultActiveThreadPercentage": 50,
        "defaultPinnedDeviceMemoryLimit": "10Gi",
    }
    ts = one("ResourceClaimTemplate", "time-sliced-gpu")["spec"]["spec"]["devices"]["config"][0]
    assert ts["opaque"]["parameters"]["sharing"]["timeSlicingConfig"] == {"interval": "Long"}


def nvlink_sets(template: str, slices: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Device sets of the request's count whose constraint attribute is equal, as the scheduler requires."""
    devices = one("ResourceClaimTemplate", template)["spec"]["spec"]["devices"]
    count = devices["requests"][0]["exactly"]["count"]
    (constraint,) = devices["constraints"]
    domain, _, ident = constraint["matchAttribute"].rpartition("/")
    pool = candidates(template, slices)
    return [
        tuple(names(list(group)))
        for group in itertools.combinations(pool, count)
        if len({cel_device(d)["attributes"].get(domain, {}).get(ident) for d in group} - {None}) == 1
        and all(ident in cel_device(d)["attributes"].get(domain, {}) for d in group)
    ]


def test_eight_gpus_on_one_nvlink_domain() -> None:
    full = build_resource_slices(dgx_h100(), "node-a")
    assert nvlink_sets("eight-nvlinked-gpus", full) == [tuple(f"gpu-{i}" for i in range(8))]
    # Two NVLink islands of four GPUs each: no valid set of eight.
    islands = (
        nvswitch_inventory([h100(i) for i in range(4)]).gpus + nvswitch_inventory([h100(i) for i in range(4, 8)]).gpus
    )
    split = build_resource_slices(
        Inventory(driver_version="550.54.15", cuda_driver_version="12.4", gpus=islands), "node-a"
    )
    assert len(candidates("eight-nvlinked-gpus", split)) == 8
    assert nvlink_sets("eight-nvlinked-gpus", split) == []
