"""kube-scheduler alone, without the arbiter, keeps a ComputeDomain's pods in one NVLink clique (issue 36, item 4):
the controller pins the domain's channel template to one clique (agent.computedomain.cliques), on the API fake
(kube-scheduler's stand-in tries nodes in name order, so an unpinned domain would take the first clique's nodes
and spill over) and on the real control plane (kube-scheduler 1.37 evaluates the template's selector itself).
Racks of fake GB200 NVL72 nodes (fakes.computedomains) partitioned into two cliques. With the arbiter, which places
on its own, the pin narrows its choice too."""

from __future__ import annotations

from typing import Any

import pynvml as N
import pytest

from agent.computedomain import cliques, templates
from agent.computedomain.channels import node_clique
from agent.computedomain.model import ComputeDomain
from agent.kube.errors import NotFound
from agent.kube.rest import COMPUTE_DOMAINS, EVENTS, PODS, RESOURCE_CLAIM_TEMPLATES, RESOURCE_CLAIMS
from fakes.cluster import wait_for
from fakes.computedomains import NvlRack, RackNode
from tests.controlplane.cluster import reset
from tests.integration.test_compute_domain_placement import _nodes, domain_gang, nvl_cluster
from tests.integration.test_compute_domains import domain_doc, worker
from tests.integration.test_compute_domains_real import FOUR_GPUS, pod
from tests.integration.test_node_support import short_tmpdir

NS = "mnnvl"
SMALL = {0: 2, 1: 2, 2: 2}  # nodes 00-02 in clique 2; the others stay in the rack's clique 1


def _template(rack: NvlRack, name: str) -> dict[str, Any] | None:
    try:
        return rack.rest.get(RESOURCE_CLAIM_TEMPLATES, NS, name)
    except NotFound:
        return None


def _events(rack: NvlRack, domain: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in rack.rest.list(EVENTS, NS)["items"]
        if e.get("reason") == reason and e["involvedObject"]["name"] == domain
    ]


def _clique_of(node: RackNode) -> str | None:
    return node_clique([g.fabric for g in node.inventory().gpus])


def _set_fabric(node: RackNode, state: int) -> None:
    """Break or mend a node's fabric, and let its plugin see it as the node agent's rediscovery does."""
    node.fake.set_fabric(0, state=state)
    assert node.plugin is not None
    node.plugin.set_clique(_clique_of(node))


def _placed(rack: NvlRack, names: list[str]) -> list[RackNode]:
    nodes = [rack.pod_node(NS, n) for n in names]
    return [n for n in nodes if n is not None]


def test_every_pod_of_a_domain_lands_in_the_one_clique_that_holds_it() -> None:
    """Clique 2 (nodes 00-02) is too small for a 4-node domain, clique 1 (03-06) holds it: the template pins clique
    1, so the four workers skip nodes 00-02 that kube-scheduler's stand-in would try first."""
    with short_tmpdir("nvlc-") as root, NvlRack(root, nodes=7, cliques=SMALL) as rack:
        big = _clique_of(rack.nodes[3])
        rack.apply([domain_doc("train", 4, "train-channel")], NS)
        template = rack.wait_for(lambda: _template(rack, "train-channel"), what="the template")
        assert cliques.pinned(template) == big
        picked = rack.wait_for(lambda: _events(rack, "train", "CliquePicked"), timeout=10, what="the Event")
        assert picked[0]["message"].startswith(f"clique {big}: 4 node(s) with a free channel")
        names = [f"train-{i}" for i in range(4)]
        rack.apply([worker(n, "train-channel", 4) for n in names], NS)
        rack.wait_for(lambda: len(_placed(rack, names)) == 4, timeout=90, what="the workers placed")
        assert sorted(n.name for n in _placed(rack, names)) == [n.name for n in rack.nodes[3:]]


def test_a_pinned_clique_that_breaks_before_any_claim_is_remade_and_not_after() -> None:
    """A 3-node domain pins clique 2 (00-02; clique 1 has 2 nodes). Node 00's fabric breaks before any pod: no
    clique fits, the domain says why (the pin waits for a third node); mended, the template is on clique 2. Once a
    pod's claim is made from it, a break no longer remakes it: the domain says the claims hold it."""
    with short_tmpdir("nvlc-") as root, NvlRack(root, nodes=5, cliques=SMALL) as rack:
        small = _clique_of(rack.nodes[0])
        rack.apply([domain_doc("train", 3, "train-channel")], NS)
        first = rack.wait_for(lambda: _template(rack, "train-channel"), what="the template")
        assert cliques.pinned(first) == small

        _set_fabric(rack.nodes[0], N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
        (told,) = rack.wait_for(lambda: _events(rack, "train", "NoCliqueFits"), timeout=30, what="the Warning")
        assert told["type"] == "Warning" and told["message"].startswith(
            "no NVLink clique can take this domain's 3 node(s) now: 2 clique(s) publish IMEX channels, the most "
            "nodes with a channel free of other domains in one is 2; clique "
        )
        assert "its pods wait until 1 more of its nodes are in its complete fabric" in told["message"]

        _set_fabric(rack.nodes[0], N.NVML_GPU_FABRIC_STATE_COMPLETED)
        again = rack.wait_for(
            lambda: (t := _template(rack, "train-channel")) and cliques.pinned(t) == small and t,
            timeout=30,
            what="the template pinned on clique 2 again",
        )
        rack.apply([worker("train-0", "train-channel", 4)], NS)
        rack.wait_for(lambda: _placed(rack, ["train-0"]), timeout=60, what="the worker placed")

        _set_fabric(rack.nodes[1], N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
        (lost,) = rack.wait_for(lambda: _events(rack, "train", "CliqueLost"), timeout=30, what="the Warning")
        assert lost["message"].startswith(f"clique {small} can no longer take this domain")
        kept = _template(rack, "train-channel")
        assert kept is not None and kept["metadata"]["uid"] == again["metadata"]["uid"]


def test_a_claim_made_from_the_old_pin_while_the_template_is_remade_keeps_the_pin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tried: the race of a remake. A 2-node domain pins clique 1 (03-04, the smallest that fits); node 03's fabric
    breaks, so clique 2 (00-02) fits and the template is remade. A pod's claim is made from the old template after
    the controller looked for claims and before it deleted the template (kube-controller-manager's stand-in,
    injected at the delete). Before, the new template pinned clique 2 and the domain's pods split across two
    cliques; now the controller looks again after the delete, makes the template again on clique 1 and says the
    claims hold it."""
    with short_tmpdir("nvlc-") as root, NvlRack(root, nodes=5, cliques=SMALL) as rack:
        old = _clique_of(rack.nodes[3])
        rack.apply([domain_doc("train", 2, "train-channel")], NS)
        first = rack.wait_for(lambda: _template(rack, "train-channel"), what="the template")
        assert cliques.pinned(first) == old
        rest = rack.controller._rest
        delete = rest.delete

        def claim_made_first(resource: Any, namespace: str | None, name: str, **options: Any) -> None:
            if resource is RESOURCE_CLAIM_TEMPLATES and name == "train-channel":
                seen = rest.get(RESOURCE_CLAIM_TEMPLATES, NS, name)  # as kube-controller-manager's informer has it
                claim = {"metadata": {"name": "train-0-channel"}, "spec": seen["spec"]["spec"]}
                rest.create(RESOURCE_CLAIMS, NS, {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", **claim})
            delete(resource, namespace, name, **options)

        monkeypatch.setattr(rest, "delete", claim_made_first)
        _set_fabric(rack.nodes[3], N.NVML_GPU_FABRIC_STATE_NOT_STARTED)
        (lost,) = rack.wait_for(lambda: _events(rack, "train", "CliqueLost"), timeout=30, what="the Warning")
        assert lost["message"].startswith(f"clique {old} can no longer take this domain")
        again = _template(rack, "train-channel")
        assert again is not None and again["metadata"]["uid"] != first["metadata"]["uid"]  # deleted, made again
        assert cliques.pinned(again) == old and again["spec"] == first["spec"]


def _pending_reason(rest: Any, name: str) -> str:
    conditions = (rest.get(PODS, NS, name).get("status") or {}).get("conditions") or []
    return next((c.get("message") or "" for c in conditions if c.get("type") == "PodScheduled"), "")


@pytest.mark.controlplane
@pytest.mark.timeout(300)
def test_kube_scheduler_alone_keeps_a_domain_in_one_clique_or_leaves_it_pending(control_plane: Any) -> None:
    """The real kube-scheduler, no arbiter: of 7 nodes, 00-02 form a clique too small for a 4-node domain; the
    domain's four workers all land on 03-06. A second 4-node domain then fits no clique now (03-06 hold the first's
    channels): it is pinned to 03-06, its worker stays Pending with kube-scheduler's own reason and the domain's
    Event says why, and it runs there once the first domain's pods are gone."""
    reset(control_plane)
    with short_tmpdir("nvlcr-") as root:
        kubeconfig = control_plane.write_kubeconfig(root / "kubeconfig")
        with NvlRack(
            root,
            nodes=7,
            cliques=SMALL,
            kubeconfig=kubeconfig,
            make_node=lambda name: control_plane.add_node(name, {"kubernetes.io/hostname": name}),
        ) as rack:
            rest = rack.rest
            rack.apply([domain_doc("train", 4, "train-channel"), FOUR_GPUS], NS)
            rack.wait_for(lambda: _template(rack, "train-channel"), what="the template")
            names = [f"train-{i}" for i in range(4)]
            rack.apply([pod(n) for n in names], NS)
            rack.wait_for(lambda: len(_placed(rack, names)) == 4, timeout=120, what="the workers placed")
            assert sorted(n.name for n in _placed(rack, names)) == [n.name for n in rack.nodes[3:]]

            rack.apply([domain_doc("late", 4, "late-channel")], NS)
            late = rack.wait_for(lambda: _template(rack, "late-channel"), what="the second template")
            assert cliques.pinned(late) == _clique_of(rack.nodes[3])
            (told,) = rack.wait_for(lambda: _events(rack, "late", "NoCliqueFits"), timeout=10, what="the Warning")
            assert "other domains hold 4 of its channels; its pods wait until they end" in told["message"]
            later = pod("late-0")
            later["spec"]["resourceClaims"][1]["resourceClaimTemplateName"] = "late-channel"
            rack.apply([later], NS)
            reason = rack.wait_for(lambda: _pending_reason(rest, "late-0"), timeout=60, what="the pod's reason")
            assert "cannot allocate all claims" in reason, reason
            assert rack.pod_node(NS, "late-0") is None
            for name in names:  # the first domain's job ends: the waiting pod runs in the pinned clique
                rest.delete(PODS, NS, name)
            placed = rack.wait_for(lambda: rack.pod_node(NS, "late-0"), timeout=120, what="the waiting pod placed")
            assert placed.name in [n.name for n in rack.nodes[3:]]
            rest.delete(PODS, NS, "late-0")  # released while the kubelets' stand-ins run, so reset finds nothing
            rack.wait_for(
                lambda: not rest.list(PODS, NS)["items"] and all(not n.channel_nodes() for n in rack.nodes),
                timeout=60,
                what="the pods and their channels to go",
            )
            for domain in ("train", "late"):  # their finalizers go while the controller runs
                rest.delete(COMPUTE_DOMAINS, NS, domain)
            rack.wait_for(lambda: not rest.list(COMPUTE_DOMAINS, NS)["items"], timeout=60, what="the domains to go")
    reset(control_plane)


def test_the_arbiter_places_a_gang_in_the_clique_its_template_pins() -> None:
    """Two cliques of 4 nodes, each able to hold the 4-pod gang; the domain's template pins the second (b): the
    arbiter narrows the gang to b's nodes, where kube-scheduler's stand-in then allocates the channels."""
    with nvl_cluster({"a": 4, "b": 4}) as cluster:
        unpinned = cluster.rest.get(RESOURCE_CLAIM_TEMPLATES, NS, "train-channel")
        unpinned["metadata"]["finalizers"] = []
        cluster.rest.replace(RESOURCE_CLAIM_TEMPLATES, unpinned)
        cluster.rest.delete(RESOURCE_CLAIM_TEMPLATES, NS, "train-channel")
        domain = ComputeDomain(NS, "train", "domain-uid", 4, "train-channel", "Single")
        pinned = templates.channel_template(domain, "cluster-uuid.b")
        pinned["metadata"].pop("finalizers")
        cluster.rest.create(RESOURCE_CLAIM_TEMPLATES, NS, pinned)
        domain_gang(cluster, "train", 4)
        cluster.arbiter()
        wait_for(lambda: all(_nodes(cluster, "train").values()), timeout=60, what="the gang bound")
        assert sorted(n or "" for n in _nodes(cluster, "train").values()) == ["b-0", "b-1", "b-2", "b-3"]
