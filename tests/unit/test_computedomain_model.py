"""The pure parts of ComputeDomains: the object and status.nodes, channel configs and CDI specs, the IMEX files."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.claims.cdi import CdiStore
from agent.computedomain import channels, imexconfig, model, templates
from agent.computedomain.channels import ChannelConfig, ConfigError, DaemonConfig
from agent.computedomain.model import NOT_READY, READY, DomainNode, InvalidComputeDomain
from agent.devices.model import FabricInfo

UID = "2f0b4f3e-8d6a-4c3e-9a43-5b1b9f0e7c11"


def domain(**spec: object) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": "cd", "uid": UID},
        "spec": {"channel": {"resourceClaimTemplate": {"name": "tpl"}}, **spec},
    }


def test_a_domain_reads_with_nvidias_defaults_and_refuses_what_it_cannot_serve() -> None:
    parsed = model.parse(domain())
    assert (parsed.num_nodes, parsed.allocation_mode, parsed.template_name, parsed.status) == (
        0,
        "Single",
        "tpl",
        NOT_READY,
    )
    with pytest.raises(InvalidComputeDomain, match="spec.channel is required"):
        model.parse({"metadata": {"name": "x"}, "spec": {"numNodes": 2}})
    with pytest.raises(InvalidComputeDomain, match="allocationMode must be Single or All"):
        model.parse(domain(channel={"resourceClaimTemplate": {"name": "t"}, "allocationMode": "Some"}))
    with pytest.raises(InvalidComputeDomain, match="numNodes"):
        model.parse(domain(numNodes=-1))


def test_indexes_are_per_clique_and_fill_gaps_so_names_stay_put() -> None:
    nodes = model.with_node((), "a", "127.0.0.1", "c1", NOT_READY)
    nodes = model.with_node(nodes, "b", "127.0.0.2", "c1", NOT_READY)
    nodes = model.with_node(nodes, "x", "127.0.0.9", "c2", NOT_READY)
    assert [(n.name, n.index) for n in nodes] == [("a", 0), ("b", 1), ("x", 0)]
    nodes = model.without_node(nodes, "a")
    nodes = model.with_node(nodes, "c", "127.0.0.3", "c1", NOT_READY)  # takes a's index, b keeps its own
    assert {n.name: n.index for n in nodes} == {"b": 1, "x": 0, "c": 0}
    nodes = model.with_node(nodes, "b", "127.0.0.2", "c1", READY)  # an update keeps the index
    assert next(n for n in nodes if n.name == "b") == DomainNode("b", "127.0.0.2", "c1", 1, READY)
    assert model.clique_peers(nodes, "c1") == ("127.0.0.3", "127.0.0.2")  # index order, clique c1 only
    full = tuple(DomainNode(f"n{i}", f"127.0.0.{i}", "c1", i) for i in range(18))
    with pytest.raises(ValueError, match="already has 18 nodes"):
        model.with_node(full, "n18", "127.0.1.1", "c1", NOT_READY)


def test_the_domain_is_ready_when_numnodes_daemons_are_listed_and_all_ready() -> None:
    ready = [DomainNode("a", "1", "c", 0, READY), DomainNode("b", "2", "c", 1, READY)]
    assert model.global_status(2, ready) == READY
    assert model.global_status(3, ready) == NOT_READY
    assert model.global_status(0, [*ready, DomainNode("c", "3", "c", 2)]) == NOT_READY
    assert model.global_status(0, []) == READY  # NVIDIA's rule: nothing asked, nothing missing


def config(kind: str = "ComputeDomainChannelConfig", **fields: object) -> dict:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": kind, "domainID": UID, **fields}


def test_channel_configs_decode_strictly() -> None:
    assert channels.decode_config(config(allocationMode="All")) == ChannelConfig(UID, "All")
    assert channels.decode_config(config("ComputeDomainDaemonConfig")) == DaemonConfig(UID)
    for bad, why in [
        (config(extra=1), "unknown field"),
        (config(domainID=""), "domainID cannot be empty"),
        (config("GpuConfig"), "kind must be"),
        (config(allocationMode="Many"), "allocationMode"),
        (config("ComputeDomainDaemonConfig", allocationMode="All"), "unknown field"),
        ({**config(), "apiVersion": "v1"}, "apiVersion"),
    ]:
        with pytest.raises(ConfigError, match=why):
            channels.decode_config(bad)


def test_the_config_naming_the_request_wins_and_a_wrong_kind_is_the_claims_error() -> None:
    allocation = {
        "devices": {
            "config": [
                {
                    "source": "FromClaim",
                    "requests": ["channel"],
                    "opaque": {"driver": model.DRIVER, "parameters": config(allocationMode="All")},
                },
                {"source": "FromClass", "requests": [], "opaque": {"driver": model.DRIVER, "parameters": config()}},
                {"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.nvidia.com", "parameters": {"x": 1}}},
            ]
        }
    }
    configs = channels.configs_by_request(allocation)
    assert channels.config_for("channel", "channel-0", configs) == ChannelConfig(UID, "All")
    assert channels.config_for("other", "channel-0", configs) == ChannelConfig(UID, "Single")
    with pytest.raises(ConfigError, match="no ComputeDomainDaemonConfig"):
        channels.config_for("other", "daemon-0", configs)
    with pytest.raises(ConfigError, match="cannot apply ComputeDomainChannelConfig"):
        channels.config_for("channel", "daemon-0", configs)


PROC_DEVICES = """Character devices:
  1 mem
195 nvidia-frontend
511 nvidia-caps-imex-channels

Block devices:
511 nvidia-caps-imex-channels
"""


def test_the_channel_major_comes_from_the_character_devices_of_proc_devices() -> None:
    assert channels.imex_channels_major(PROC_DEVICES) == 511
    assert channels.imex_channels_major("Character devices:\n195 nvidia-frontend\n") is None


def test_a_claim_spec_injects_one_channel_or_every_channel() -> None:
    one = channels.claim_spec(
        "uid-1", {"channel-0": channels.channels_for(ChannelConfig(UID), 2048)}, 511, "/", {"COMPUTE_DOMAIN_UUID": UID}
    )
    assert one["kind"] == "k8s.compute-domain.nvidia.com/claim" and one["devices"][0]["name"] == "uid-1-channel-0"
    assert one["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia-caps-imex-channels/channel0", "type": "c", "major": 511, "minor": 0, "fileMode": 0o666}
    ]
    assert "NVIDIA_VISIBLE_DEVICES=void" in one["devices"][0]["containerEdits"]["env"]
    every = channels.claim_spec(
        "uid-1", {"channel-0": channels.channels_for(ChannelConfig(UID, "All"), 2048)}, 511, "/run/dev", {}
    )
    nodes = every["devices"][0]["containerEdits"]["deviceNodes"]
    assert len(nodes) == 2048 and nodes[-1]["minor"] == 2047
    assert nodes[5]["hostPath"] == "/run/dev/dev/nvidia-caps-imex-channels/channel5"
    store = CdiStore(Path("/var/run/cdi"), kind=channels.CDI_KIND)
    assert store.path("uid-1").name == "k8s.compute-domain.nvidia.com-claim_uid-1.json"


def test_a_node_serves_channels_only_when_every_gpu_is_in_one_clique() -> None:
    assert channels.clique_of(["u.1", "u.1"]) == "u.1"
    assert channels.clique_of(["u.1", None]) is None
    assert channels.clique_of(["u.1", "u.2"]) is None
    assert channels.clique_of([]) is None


def test_a_node_whose_fabric_is_degraded_offers_no_channels() -> None:
    # a degraded bandwidth (healthMask DEGRADED_BW) on any GPU: the clique is not offered to new domains
    whole, degraded = FabricInfo("u", 1), FabricInfo("u", 1, degraded=True)
    assert channels.node_clique([whole, whole]) == "u.1"
    assert channels.node_clique([whole, degraded]) is None
    assert channels.node_clique([whole, None]) is None  # registration not COMPLETED: discovery reports no fabric


def test_the_published_devices_are_nvidias_with_their_clique() -> None:
    body = channels.resource_slice("n1", "node-uid", 3, "u.1")
    assert [
        (d["name"], d["attributes"]["type"]["string"], d["attributes"]["id"]["int"]) for d in body["spec"]["devices"]
    ] == [("channel-0", "channel", 0), ("daemon-0", "daemon", 0)]
    assert {d["attributes"]["cliqueID"]["string"] for d in body["spec"]["devices"]} == {"u.1"}
    assert body["spec"]["pool"] == {"name": "n1", "generation": 3, "resourceSliceCount": 1}


def test_the_imex_files() -> None:
    text = imexconfig.daemon_config("/state/nodes.cfg", "127.0.0.5")
    settings = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert settings["IMEX_NODE_CONFIG_FILE"] == "/state/nodes.cfg"
    assert settings["IMEX_CMD_BIND_INTERFACE_IP"] == "127.0.0.5" and settings["DAEMONIZE"] == "0"
    assert imexconfig.nodes_config(["127.0.0.1", "127.0.0.2"]) == "127.0.0.1\n127.0.0.2\n"
    assert imexconfig.is_ready("READY\n") and not imexconfig.is_ready("READY") and not imexconfig.is_ready("")


def test_the_channel_template_is_nvidias() -> None:
    tpl = templates.channel_template(
        model.parse(domain(channel={"resourceClaimTemplate": {"name": "tpl"}, "allocationMode": "All"}))
    )
    assert tpl["metadata"]["labels"] == {
        "resource.nvidia.com/computeDomain": UID,
        "resource.nvidia.com/computeDomainTarget": "workload",
    }
    request = tpl["spec"]["spec"]["devices"]["requests"][0]
    assert request == {"name": "channel", "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"}}
    assert templates.belongs_to(tpl, UID) and not templates.belongs_to(tpl, "other")
