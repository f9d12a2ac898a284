"""Issue 33 item 9: the node agents authenticate the arbiter by its service-account token (TokenReview, with the
audience set, cached), and the arbiter reads its projected token anew, so a rotated token needs no restart.
Against the API server fake's TokenRequest and TokenReview; tests/integration/test_reservation_tokens_real.py
checks the same against kube-apiserver."""

from __future__ import annotations

import pathlib
import secrets
from collections.abc import Iterator
from typing import Any

import pytest

from agent.allocation.allocator import Claim, DeviceRequest
from agent.arbiter.controller import NodeDirectory
from agent.kube.rest import NODES, Resource, Rest
from agent.names import ARBITER_USER, FINGERPRINT_ANNOTATION, RESERVATION_AUDIENCE
from agent.reservation.auth import TokenFile, TokenFileError, TokenReviewer
from agent.reservation.node_service import NodeReservations
from agent.reservation.protocol import NodeUnavailable, Unauthenticated
from fakes.cluster import arbiter_token
from tests.unit.test_allocation_allocator import gpu, inventory

apiserver = pytest.importorskip("fakes.apiserver")

NODE = "gpu-node-1"
MEMBER = "default/trainer-0/gpus"
ONE = Claim((DeviceRequest("gpus"),))


def token_of(rest: Rest, namespace: str, account: str, audiences: list[str]) -> str:
    request = Resource("", "v1", f"serviceaccounts/{account}/token", True)
    answer = rest.create(
        request,
        namespace,
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {"audiences": audiences}},
    )
    return str(answer["status"]["token"])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server() -> Iterator[Any]:
    with apiserver.start(port=0) as s:
        s.rest().create(NODES, None, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        yield s


@pytest.fixture
def node(server: Any) -> Iterator[tuple[NodeReservations, TokenReviewer]]:
    rest = server.rest()
    reviewer = TokenReviewer(rest)
    inv = inventory(*(gpu(i, "A") for i in range(4)))
    service = NodeReservations(
        node_name=NODE,
        driver="gpu.nvidia.com",
        inventory=lambda: inv,
        prepared=lambda: (),
        unhealthy=lambda: (),
        token=reviewer,
        rest=rest,
    )
    service.start("127.0.0.1:0")
    yield service, reviewer
    service.stop()


def directory(rest: Rest, service: NodeReservations, token: Any) -> NodeDirectory:
    published = rest.get(NODES, None, NODE)["metadata"]["annotations"][FINGERPRINT_ANNOTATION]
    d = NodeDirectory(token, fingerprint=lambda _node: published)
    d.addresses = {NODE: f"127.0.0.1:{service.port}"}
    return d


def write(path: pathlib.Path, token: str) -> None:
    """As kubelet updates a projected token: a new file put in place of the old."""
    fresh = path.with_name(f".{secrets.token_hex(4)}")
    fresh.write_text(token)
    fresh.replace(path)


def test_the_arbiters_token_reserves_and_is_reviewed_once(
    server: Any, node: tuple[NodeReservations, TokenReviewer]
) -> None:
    service, reviewer = node
    rest = server.rest()
    d = directory(rest, service, arbiter_token(rest))
    client = d.clients()[NODE]
    r = client.reserve("g", MEMBER, ONE, 30)
    client.confirm(r.id)
    assert client.capacity().free_gpu_milli == 3000
    assert client.release(gang_id="g") == 1
    assert reviewer.reviews == 1  # a TokenReview per token, not per call (each call is checked twice)
    d.close()


def test_tokens_that_are_not_the_arbiters_for_this_audience_are_refused(
    server: Any, node: tuple[NodeReservations, TokenReviewer]
) -> None:
    """Tried (before): one shared Secret token reserved every node's GPUs for whoever held it."""
    service, _ = node
    rest = server.rest()
    namespace = ARBITER_USER.split(":")[2]
    arbiter_token(rest)  # the namespace and the arbiter's account
    rest.create(
        Resource("", "v1", "serviceaccounts", True),
        namespace,
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "someone-else"}},
    )
    refusals = {
        "another account's token for the audience": (
            token_of(rest, namespace, "someone-else", [RESERVATION_AUDIENCE]),
            f"system:serviceaccount:{namespace}:someone-else may not reserve devices here: only {ARBITER_USER} may",
        ),
        "the arbiter's token for the API server": (
            token_of(rest, namespace, "gpu-dra-agent-arbiter", ["https://kubernetes.default.svc"]),
            "the API server does not accept the token: [invalid bearer token, token audiences "
            '["https://kubernetes.default.svc"] is invalid for the target audiences ["gpu-dra-agent-reservations"]]',
        ),
        "a shared secret": ("s3cret-token", "the API server does not accept the token: invalid bearer token"),
    }
    for what, (token, why) in refusals.items():
        d = directory(rest, service, token)
        with pytest.raises(Unauthenticated, match=why.replace("[", r"\[").replace("]", r"\]")):
            d.clients()[NODE].reserve("g", MEMBER, ONE, 30)
        d.close()
        assert service.book.live() == [], what


def test_answers_are_cached_for_a_while_and_the_cache_is_bounded(server: Any) -> None:
    rest = server.rest()
    clock = Clock()
    reviewer = TokenReviewer(rest, clock=clock, accepted_ttl_s=30, refused_ttl_s=5, entries=2)
    good = arbiter_token(rest)
    reviewer.authenticate(good)
    clock.now += 29
    reviewer.authenticate(good)
    assert reviewer.reviews == 1
    clock.now += 2  # past the TTL: asked again
    reviewer.authenticate(good)
    assert reviewer.reviews == 2
    for bad in ("bad-1", "bad-1", "bad-2"):
        with pytest.raises(Unauthenticated):
            reviewer.authenticate(bad)
    assert reviewer.reviews == 4  # bad-1 was refused from the cache the second time
    reviewer.authenticate(good)  # two entries at most: the good token was the oldest and went out
    assert reviewer.reviews == 5


def test_a_token_review_that_fails_is_unavailable_and_not_remembered(
    server: Any, node: tuple[NodeReservations, TokenReviewer]
) -> None:
    """E.g. the agent's RBAC lacks `create` on tokenreviews: the node says it cannot check the token."""
    service, reviewer = node
    rest = server.rest()
    d = directory(rest, service, arbiter_token(rest))
    server.faults.fail("POST", "/tokenreviews$", status=403)
    with pytest.raises(NodeUnavailable, match="UNAVAILABLE: cannot check the caller's token: TokenReview failed"):
        d.clients()[NODE].reserve("g", MEMBER, ONE, 30)
    assert d.clients()[NODE].reserve("g", MEMBER, ONE, 30).fit.all_devices  # the next review succeeds
    d.close()


def test_a_rotated_token_is_read_and_used_without_a_restart(
    server: Any, node: tuple[NodeReservations, TokenReviewer], tmp_path: pathlib.Path
) -> None:
    """Tried (before): the arbiter read its token once; after a rotation every node refused it until restarted.
    Here the old token is revoked the moment the file changes: the next call carries the new one."""
    service, _ = node
    rest = server.rest()
    path = tmp_path / "token"
    old = arbiter_token(rest)
    write(path, old)
    token = TokenFile(path)
    d = directory(rest, service, token)
    client = d.clients()[NODE]
    assert client.reserve("g1", MEMBER, ONE, 30).fit.all_devices
    write(path, arbiter_token(rest))
    server.tokens.revoke(old)
    assert client.reserve("g2", MEMBER, ONE, 30).fit.all_devices  # the same client, the new token
    assert token.reads == 2
    assert client.capacity().free_gpu_milli == 2000
    path.write_text("")
    with pytest.raises(Unauthenticated, match="no token to send: the reservation token file .* is empty"):
        client.capacity()
    path.unlink()
    with pytest.raises(TokenFileError, match="cannot read"):
        token()
    d.close()


def test_the_arbiter_keeps_admitting_across_a_token_rotation() -> None:
    """The rotation trial: an arbiter admits a gang; its token is rotated and the old one revoked (as it expires
    on a cluster); the next gang is admitted by the same arbiter. Tried (before): the arbiter kept the token it
    read at start, every Reserve was UNAUTHENTICATED and the gang waited ("NotAdmitted ... Unauthenticated",
    no node named) until the arbiter was restarted."""
    from fakes.cluster import FakeCluster, wait_for

    def bound(cluster: FakeCluster, prefix: str) -> int:
        return sum(
            1 for p in cluster.pods("team-a") if p["metadata"]["name"].startswith(prefix) and p["spec"].get("nodeName")
        )

    with FakeCluster(nodes=2) as cluster:
        cluster.queue("team-a", gpu_quota=16)
        cluster.arbiter()
        cluster.gang("team-a", "before", "team-a", pods=2, gpus=2)
        wait_for(lambda: bound(cluster, "before-") == 2, timeout=60, what="the gang before the rotation")
        old = cluster.token
        cluster.rotate_token()
        assert cluster.server is not None
        cluster.server.tokens.revoke(old)
        for agent in cluster.agents.values():
            agent.service._auth._cache.clear()  # type: ignore[attr-defined]  # its 30 s have passed
        cluster.gang("team-a", "after", "team-a", pods=2, gpus=2)
        wait_for(lambda: bound(cluster, "after-") == 2, timeout=30, what="the gang after the rotation")
