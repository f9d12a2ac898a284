"""ComputeDomains on the API fake with many nodes of a fake GB200 NVL72 rack (fakes.computedomains): the
controller makes the channel template, each node's compute-domain plugin prepares channels over its real kubelet
sockets and runs one IMEX daemon per domain (the fake nvidia-imex), and status.nodes follows."""

from __future__ import annotations

import pathlib
from typing import Any

import pynvml as N
import pytest
import yaml

from agent.computedomain import model, templates
from agent.computedomain.controller import COMPUTE_DOMAINS as COMPUTE_DOMAINS_RESOURCE
from agent.computedomain.model import READY
from agent.kube.errors import NotFound
from agent.kube.rest import EVENTS, PODS, RESOURCE_CLAIM_TEMPLATES
from fakes.computedomains import NvlRack
from tests.integration.test_node_support import short_tmpdir

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "nvidia-imex"
NS = "mnnvl"


def domain_doc(name: str, nodes: int, template: str, mode: str | None = None) -> dict:
    channel: dict = {"resourceClaimTemplate": {"name": template}}
    if mode:
        channel["allocationMode"] = mode
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": name},
        "spec": {"numNodes": nodes, "channel": channel},
    }


def worker(name: str, template: str, gpus: int) -> dict:
    """A worker of a multi-node job: `gpus` GPUs through the device-plugin-style resource (the DeviceClass maps
    nvidia.com/gpu), and the domain's channel, as NVIDIA's nvbandwidth job asks for them."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"job": "train"}},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "trainer:1",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}, "claims": [{"name": "channel"}]},
                }
            ],
            "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": template}],
        },
    }


@pytest.fixture
def rack():
    with short_tmpdir("nvl-") as root, NvlRack(root, nodes=5) as rack:
        yield rack


def test_a_four_node_domain_job_of_16_gpus_gets_one_channel_per_pod_and_a_daemon_per_node(rack: NvlRack) -> None:
    rack.apply([domain_doc("train", 4, "train-channel")], NS)
    # the controller makes the template the domain names: one channel request, the domain's UID as config
    template = rack.wait_for(lambda: _get(rack, RESOURCE_CLAIM_TEMPLATES, NS, "train-channel"), what="template")
    uid = rack.domain(NS, "train")["metadata"]["uid"]
    params = template["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"]
    assert params == {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomainChannelConfig",
        "domainID": uid,
        "allocationMode": "Single",
    }
    assert template["metadata"]["ownerReferences"][0]["uid"] == uid

    rack.apply([worker(f"train-{i}", "train-channel", 4) for i in range(4)], NS)
    rack.wait_for(
        lambda: all(_running(rack, f"train-{i}") for i in range(4)), timeout=90, what="the four workers to start"
    )
    nodes = [rack.pod_node(NS, f"train-{i}") for i in range(4)]
    assert len({n.name for n in nodes if n}) == 4  # 4 GPUs a node: one worker each, 16 GPUs in all
    addresses = sorted(n.address for n in nodes if n)
    for node in nodes:
        assert node is not None
        assert node.channel_nodes() == ["channel0"]  # exactly one channel on each node
        spec = yaml.safe_load((node.cdi_root / node.cdi_specs()[0]).read_text())
        device_nodes = [n for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"]]
        assert [(n["path"], n["major"], n["minor"]) for n in device_nodes] == [
            ("/dev/nvidia-caps-imex-channels/channel0", 234, 0)
        ]
        assert device_nodes[0]["hostPath"] == str(node.dev_root / "dev/nvidia-caps-imex-channels/channel0")
        # every node's daemon config names exactly the four nodes, and that is what its daemon loaded
        rack.wait_for(
            lambda node=node: sorted(node.daemon_nodes().get(uid, [])) == addresses,
            timeout=30,
            what=f"{node.name}'s daemon to load the four peers",
        )
    idle = next(n for n in rack.nodes if n not in nodes)
    assert idle.daemon_nodes() == {} and idle.channel_nodes() == []

    domain = rack.wait_for(lambda: _ready(rack, "train"), timeout=30, what="the domain to be Ready")
    entries = domain["status"]["nodes"]
    assert sorted(e["ipAddress"] for e in entries) == addresses
    assert sorted(e["index"] for e in entries) == [0, 1, 2, 3]
    assert {e["status"] for e in entries} == {READY} and len({e["cliqueID"] for e in entries}) == 1

    # deleting the job tears down the daemons and the channels; deleting the domain, its template
    for i in range(4):
        rack.rest.delete(PODS, NS, f"train-{i}")
    rack.wait_for(
        lambda: all(not n.channel_nodes() and not n.cdi_specs() and not n.daemon_nodes() for n in rack.nodes),
        timeout=60,
        what="channels and daemons to go",
    )
    rack.wait_for(
        lambda: rack.domain(NS, "train")["status"].get("nodes", []) == [],
        timeout=30,
        what="every node to leave status.nodes",
    )
    rack.rest.delete(COMPUTE_DOMAINS_RESOURCE, NS, "train")
    rack.wait_for(
        lambda: (
            _get(rack, COMPUTE_DOMAINS_RESOURCE, NS, "train") is None
            and _get(rack, RESOURCE_CLAIM_TEMPLATES, NS, "train-channel") is None
        ),
        timeout=30,
        what="the domain and its template to go",
    )


def _get(rack: NvlRack, resource, namespace: str, name: str):
    try:
        return rack.rest.get(resource, namespace, name)
    except NotFound:
        return None


def _running(rack: NvlRack, name: str) -> bool:
    pod = _get(rack, PODS, NS, name)
    return bool(pod and (pod.get("status") or {}).get("phase") == "Running")


def _ready(rack: NvlRack, name: str):
    domain = rack.domain(NS, name)
    return domain if (domain.get("status") or {}).get("status") == READY else None


def nvidia_spec(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((FIXTURES / name).read_text()) if d]


@pytest.mark.parametrize(
    "spec, channels",
    [("channel-injection.yaml", ["channel0"]), ("channel-injection-all.yaml", [f"channel{i}" for i in range(2048)])],
)
def test_nvidias_channel_injection_specs_apply_unchanged(rack: NvlRack, spec: str, channels: list[str]) -> None:
    docs = nvidia_spec(spec)
    pod = next(d for d in docs if d["kind"] == "Pod")["metadata"]["name"]
    rack.apply(docs, NS)
    rack.wait_for(lambda: _running(rack, pod), timeout=90, what=f"{pod} to start")
    node = rack.pod_node(NS, pod)
    assert node is not None
    assert node.channel_nodes() == sorted(channels)
    spec_doc = yaml.safe_load((node.cdi_root / node.cdi_specs()[0]).read_text())
    injected = [n["path"] for d in spec_doc["devices"] for n in d["containerEdits"]["deviceNodes"]]
    assert sorted(injected) == sorted(f"/dev/nvidia-caps-imex-channels/{c}" for c in channels)
    rack.rest.delete(PODS, NS, pod)
    rack.wait_for(
        lambda: not node.channel_nodes() and not node.cdi_specs() and not node.daemon_nodes(),
        timeout=60,
        what="the channels and the daemon to go",
    )


def test_nvidias_nvbandwidth_job_applies_unchanged(rack: NvlRack) -> None:
    """The MPIJob's four workers (2 GPUs each through nvidia.com/gpu, one channel) land on four nodes; each sees
    one channel and every daemon spans the four. The MPI operator is a stand-in that makes the workers only."""
    rack.apply(nvidia_spec("nvbandwidth-test-job.yaml"), NS)
    workers = [f"nvbandwidth-test-worker-{i}" for i in range(4)]
    rack.wait_for(lambda: all(_running(rack, w) for w in workers), timeout=120, what="the workers to start")
    nodes = [rack.pod_node(NS, w) for w in workers]
    assert len({n.name for n in nodes if n}) == 4
    uid = rack.domain(NS, "nvbandwidth-test-compute-domain")["metadata"]["uid"]
    addresses = sorted(n.address for n in nodes if n)
    for node in nodes:
        assert node is not None and node.channel_nodes() == ["channel0"]
        rack.wait_for(
            lambda node=node: sorted(node.daemon_nodes().get(uid, [])) == addresses,
            timeout=30,
            what=f"{node.name}'s daemon to span the four workers",
        )
    rack.wait_for(lambda: _ready(rack, "nvbandwidth-test-compute-domain"), timeout=30, what="Ready")


def test_nodes_in_different_cliques_never_share_a_daemon_config() -> None:
    """The controller's template keeps a domain in one clique; claims of a template without that pin (written by
    hand, or made before the controller pinned cliques) can still put it in two, and nodes of different cliques
    must then run separate IMEX domains."""
    with short_tmpdir("nvl-") as root, NvlRack(root, nodes=4, cliques={2: 2, 3: 2}) as rack:
        rack.apply([domain_doc("split", 4, "split-channel")], NS)
        rack.wait_for(lambda: _get(rack, RESOURCE_CLAIM_TEMPLATES, NS, "split-channel"), what="template")
        unpinned = templates.channel_template(model.parse(rack.domain(NS, "split")))
        unpinned["metadata"] = {"name": "split-unpinned"}
        rack.rest.create(RESOURCE_CLAIM_TEMPLATES, NS, unpinned)
        pods = []
        for i, node in enumerate(rack.nodes):
            pod = worker(f"split-{i}", "split-unpinned", 4)
            pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node.name}
            pods.append(pod)
        rack.apply(pods, NS)
        rack.wait_for(lambda: all(_running(rack, f"split-{i}") for i in range(4)), timeout=90, what="workers")
        uid = rack.domain(NS, "split")["metadata"]["uid"]
        first, second = rack.nodes[:2], rack.nodes[2:]
        for group in (first, second):
            peers = sorted(n.address for n in group)
            for node in group:
                rack.wait_for(
                    lambda node=node, peers=peers: sorted(node.daemon_nodes().get(uid, [])) == peers,
                    timeout=30,
                    what=f"{node.name}'s daemon to list its clique only",
                )
        entries = rack.wait_for(lambda: _ready(rack, "split"), timeout=30, what="Ready")["status"]["nodes"]
        by_clique: dict[str, list[int]] = {}
        for e in entries:
            by_clique.setdefault(e["cliqueID"], []).append(e["index"])
        assert sorted(sorted(v) for v in by_clique.values()) == [[0, 1], [0, 1]]  # (cliqueID, index) unique


def test_a_fabric_broken_mid_job_makes_the_domain_not_ready(rack: NvlRack) -> None:
    rack.apply(
        [
            domain_doc("fragile", 2, "fragile-channel"),
            worker("fragile-0", "fragile-channel", 4),
            worker("fragile-1", "fragile-channel", 4),
        ],
        NS,
    )
    rack.wait_for(lambda: _ready(rack, "fragile"), timeout=90, what="the domain to be Ready")
    node = rack.pod_node(NS, "fragile-0")
    assert node is not None
    node.fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_NOT_STARTED)  # the node drops out of the fabric
    domain = rack.wait_for(lambda: _not_ready(rack, "fragile"), timeout=30, what="the domain to be NotReady")
    assert {e["name"]: e["status"] for e in domain["status"]["nodes"]}[node.name] == "NotReady"
    node.fake.set_fabric(0, state=N.NVML_GPU_FABRIC_STATE_COMPLETED)
    rack.wait_for(lambda: _ready(rack, "fragile"), timeout=30, what="the domain to be Ready again")


def test_a_template_name_taken_by_something_else_is_left_alone_and_told(rack: NvlRack) -> None:
    rack.namespace(NS)
    theirs = rack.rest.create(
        RESOURCE_CLAIM_TEMPLATES,
        NS,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "taken"},
            "spec": {
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}}
            },
        },
    )
    rack.apply([domain_doc("clash", 1, "taken")], NS)
    event = rack.wait_for(
        lambda: next(
            (e for e in rack.rest.list(EVENTS, NS)["items"] if e.get("reason") == "ResourceClaimTemplateTaken"), None
        ),
        timeout=30,
        what="a Warning Event on the domain",
    )
    assert event["type"] == "Warning" and event["involvedObject"]["name"] == "clash"
    assert rack.rest.get(RESOURCE_CLAIM_TEMPLATES, NS, "taken")["metadata"]["uid"] == theirs["metadata"]["uid"]
    rack.rest.delete(COMPUTE_DOMAINS_RESOURCE, NS, "clash")
    rack.wait_for(lambda: _get(rack, COMPUTE_DOMAINS_RESOURCE, NS, "clash") is None, timeout=30, what="deletion")
    assert _get(rack, RESOURCE_CLAIM_TEMPLATES, NS, "taken") is not None  # not the domain's: never deleted


def _not_ready(rack: NvlRack, name: str):
    domain = rack.domain(NS, name)
    return domain if (domain.get("status") or {}).get("status") == "NotReady" else None


class _Reads:
    """The controller's API client, counting what it reads from the API server itself (its informers aside)."""

    def __init__(self, rest: Any) -> None:
        self._rest, self.reads = rest, 0

    def get(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return self._rest.get(*args, **kwargs)

    def list(self, *args: Any, **kwargs: Any) -> Any:
        self.reads += 1
        return self._rest.list(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rest, name)


def test_passes_over_settled_domains_read_from_the_informers_alone(rack: NvlRack) -> None:
    """Tried: three domains settled (their templates made, one Ready with its pods), then twenty passes with nothing
    changed: the controller reads each domain, its template, the slices and the claims from its informers, so the
    passes make no request of the API server (before, each pass made two GETs a domain); and they change nothing."""
    rack.apply([domain_doc(f"quiet-{i}", 1, f"quiet-{i}-channel") for i in range(3)], NS)
    rack.apply([worker("quiet-pod", "quiet-0-channel", 4)], NS)
    rack.wait_for(lambda: _ready(rack, "quiet-0"), timeout=90, what="the first domain to be Ready")
    for i in range(3):
        rack.wait_for(
            lambda i=i: rack.controller.templates.get(NS, f"quiet-{i}-channel"), timeout=30, what="templates seen"
        )
    templates_before = {t["metadata"]["name"]: t["metadata"]["resourceVersion"] for t in _templates(rack)}
    spy = _Reads(rack.controller._rest)
    rack.controller._rest = spy  # type: ignore[assignment]
    try:
        for _ in range(20):
            rack.controller.reconcile_all()
    finally:
        rack.controller._rest = spy._rest
    assert spy.reads == 0
    assert {t["metadata"]["name"]: t["metadata"]["resourceVersion"] for t in _templates(rack)} == templates_before


def _templates(rack: NvlRack) -> list[dict]:
    return [
        t for t in rack.rest.list(RESOURCE_CLAIM_TEMPLATES, NS)["items"] if t["metadata"]["name"].startswith("quiet")
    ]
