"""The clique a ComputeDomain's template pins (agent.computedomain.cliques), from slices and claims as the API
serves them: nodes that publish a channel, other domains' channels, free GPUs, ties, numNodes 0 and no fit."""

from __future__ import annotations

from typing import Any

from agent.allocation.cel import DeviceSelector, device_variable
from agent.computedomain import channels, cliques, templates
from agent.computedomain.model import DRIVER, ComputeDomain

GPU_DRIVER = "gpu.nvidia.com"
UID = "domain-uid"


def channel_slice(node: str, clique: str) -> dict[str, Any]:
    return channels.resource_slice(node, None, 0, clique)


def gpu_slice(node: str, gpus: int) -> dict[str, Any]:
    return {
        "spec": {
            "driver": GPU_DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 0, "resourceSliceCount": 1},
            "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}} for i in range(gpus)],
        }
    }


def claim(domain: str | None, results: list[tuple[str, str, str]]) -> dict[str, Any]:
    """A claim of `domain`'s template (None: a GPU claim) holding (driver, pool, device) results."""
    config = (
        [{"opaque": {"driver": DRIVER, "parameters": {"kind": "ComputeDomainChannelConfig", "domainID": domain}}}]
        if domain
        else []
    )
    return {
        "spec": {"devices": {"requests": [], "config": config}},
        "status": {
            "allocation": {
                "devices": {"results": [{"driver": d, "pool": p, "device": n, "request": "r"} for d, p, n in results]}
            }
        },
    }


def rack(cliques_: dict[str, int], gpus: int = 4) -> list[dict[str, Any]]:
    """Nodes `<clique>-<i>` with `gpus` GPUs each, publishing their channel in their clique."""
    out = []
    for clique, count in cliques_.items():
        for i in range(count):
            out += [channel_slice(f"{clique}-{i}", clique), gpu_slice(f"{clique}-{i}", gpus)]
    return out


def pick(slices: list[dict[str, Any]], claims: list[dict[str, Any]], num_nodes: int) -> cliques.Pick:
    return cliques.choose(cliques.read_fabric(slices, claims, GPU_DRIVER).rooms(UID), num_nodes)


def test_the_smallest_clique_that_holds_the_domain_is_picked() -> None:
    """Cliques of 3, 4 and 6 nodes, a 4-node domain: the 3-node one cannot hold it; of the others the smaller is
    taken (the 6-node clique stays for a larger domain)."""
    assert pick(rack({"a": 3, "b": 4, "c": 6}), [], 4).clique == "b"


def test_equal_cliques_are_told_apart_by_their_id() -> None:
    slices = rack({"y": 4, "x": 4})
    assert pick(slices, [], 2).clique == "x" == pick(list(reversed(slices)), [], 2).clique


def test_nodes_whose_channel_another_domain_holds_do_not_count() -> None:
    """Clique b has 4 nodes but another domain holds the channel of one: only c (5 nodes) can take 4."""
    other = claim("other-domain", [(DRIVER, "b-0", "channel-0")])
    assert pick(rack({"b": 4, "c": 5}), [other], 4).clique == "c"


def test_the_domains_own_channels_still_count() -> None:
    mine = claim(UID, [(DRIVER, "b-0", "channel-0")])
    assert pick(rack({"b": 4, "c": 5}), [mine], 4).clique == "b"


def test_a_clique_with_room_comes_before_a_smaller_one_whose_gpus_are_all_taken() -> None:
    """b (4 nodes) fits by size but two of its nodes have every GPU allocated: c, with room on 4 nodes, wins."""
    busy = [
        claim(None, [(GPU_DRIVER, node, f"gpu-{i}") for i in range(4)])  # every GPU of b-0 and b-1
        for node in ("b-0", "b-1")
    ]
    assert pick(rack({"b": 4, "c": 5}), busy, 4).clique == "c"


def test_without_room_anywhere_the_roomiest_clique_that_fits_is_picked() -> None:
    """No clique has 4 nodes with a free GPU: b (4 nodes) keeps one such node, c (5 nodes) two; c is picked,
    where best fit alone would take b."""
    full = ("b-0", "b-1", "b-2", "c-0", "c-1", "c-2")
    busy = [claim(None, [(GPU_DRIVER, n, f"gpu-{i}") for i in range(4)]) for n in full]
    assert pick(rack({"b": 4, "c": 5}), busy, 4).clique == "c"


def test_a_domain_of_numnodes_0_gets_the_roomiest_clique() -> None:
    """numNodes 0 (NVIDIA allows it: the size is not known): the clique with most nodes with room."""
    assert pick(rack({"a": 3, "b": 6, "c": 4}), [], 0).clique == "b"


def test_no_clique_large_enough_pins_the_largest_and_its_pods_wait() -> None:
    """No clique has 4 nodes: the largest (a, 3 nodes) is pinned, so its pods run once a fourth node's fabric there
    is whole, rather than never (a template naming no clique could not be remade once pods' claims copy it)."""
    chosen = pick(rack({"a": 3, "b": 2}), [], 4)
    assert (chosen.clique, chosen.now) == ("a", False)
    assert chosen.why == (
        "no NVLink clique can take this domain's 4 node(s) now: 2 clique(s) publish IMEX channels, the most nodes "
        "with a channel free of other domains in one is 3; clique a (3 node(s) with a channel) is pinned: its pods "
        "wait until 1 more of its nodes are in its complete fabric"
    )


def test_cliques_held_by_other_domains_pin_the_one_that_frees_first() -> None:
    """Other domains hold channels in both 4-node cliques (b: 3 held, c: 1 held): c is pinned, its pods wait for
    the one domain there to end; a 2-node clique (a, all free) is never pinned, it could not hold the domain."""
    held = [claim("other", [(DRIVER, n, "channel-0")]) for n in ("b-0", "b-1", "b-2", "c-0")]
    chosen = pick(rack({"a": 2, "b": 4, "c": 4}), held, 4)
    assert (chosen.clique, chosen.now) == ("c", False)
    assert chosen.why.endswith(
        "clique c (4 node(s) with a channel) is pinned: other domains hold 1 of its channels; "
        "its pods wait until they end"
    )
    rooms = cliques.read_fabric(rack({"a": 2, "b": 4, "c": 4}), held, GPU_DRIVER).rooms(UID)
    assert cliques.holds(rooms, "c", 4) and not cliques.fits(rooms, "c", 4) and not cliques.holds(rooms, "a", 4)


def test_no_channel_anywhere_says_so() -> None:
    chosen = pick([gpu_slice("n", 8)], [], 1)
    assert (chosen.clique, chosen.now) == (cliques.NONE, False)
    assert chosen.why.startswith("no node publishes IMEX channels")


def test_fits_follows_the_cliques_free_channels() -> None:
    rooms = cliques.read_fabric(rack({"b": 4}), [claim("other", [(DRIVER, "b-3", "channel-0")])], GPU_DRIVER).rooms(UID)
    assert cliques.fits(rooms, "b", 3) and not cliques.fits(rooms, "b", 4)
    assert not cliques.fits(rooms, cliques.NONE, 0)


def test_one_reading_of_the_fabric_serves_every_domain() -> None:
    """Read once a pass for all domains: a channel held by a domain's own claim is room for that domain and taken
    for every other; a GPU any claim holds is not free for either."""
    held = [claim(UID, [(DRIVER, "b-3", "channel-0"), (GPU_DRIVER, "b-3", "gpu-0")])]
    fabric = cliques.read_fabric(rack({"b": 4}), held, GPU_DRIVER)
    own, other = fabric.rooms(UID), fabric.rooms("another-domain")
    assert cliques.fits(own, "b", 4) and not own["b-3"].taken
    assert other["b-3"].taken and not cliques.fits(other, "b", 4) and cliques.fits(other, "b", 3)
    assert own["b-3"].free_gpus == other["b-3"].free_gpus == 3


def test_the_templates_selector_matches_the_picked_cliques_channels_only() -> None:
    """The pinned template's CEL selector, run as kube-scheduler runs it on the published channel devices."""
    domain = ComputeDomain("ns", "d", UID, 4, "d-channel", "Single")
    template = templates.channel_template(domain, "uuid.7")
    assert cliques.pinned(template) == "uuid.7"
    (sel,) = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]
    selector = DeviceSelector(sel["cel"]["expression"])
    devices = {c: channels.slice_devices(c)[0] for c in ("uuid.7", "uuid.8")}
    assert [c for c, d in devices.items() if selector.matches(device_variable(DRIVER, d))] == ["uuid.7"]
    nothing = DeviceSelector(cliques.selector(cliques.NONE))
    assert not any(nothing.matches(device_variable(DRIVER, d)) for d in devices.values())
    assert cliques.pinned(templates.channel_template(domain, cliques.NONE)) == cliques.NONE
    assert cliques.pinned(templates.channel_template(domain)) is None  # made before cliques were picked
