"""The informer and leader election against the API server fake: list + watch, bookmarks, relist on 410,
resume after a dropped watch; one leader at a time, a standby takes over when the leader stops renewing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.kube.informer import Informer
from agent.kube.leader import LeaderElector
from agent.kube.rest import LEASES, NODES, Rest

apiserver = pytest.importorskip("fakes.apiserver")


@pytest.fixture
def server() -> Iterator[Any]:
    with apiserver.start(port=0, history=5, bookmark_interval=0.1) as s:
        yield s


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def names(inf: Informer) -> set[str]:
    return {o["metadata"]["name"] for o in inf.items()}


def test_the_copy_follows_creates_updates_and_deletes(server: Any) -> None:
    rest = server.rest()
    rest.create(NODES, None, node("a"))
    changed = threading.Event()
    inf = Informer(rest, NODES, changed.set).start()
    try:
        assert inf.wait_synced(5) and names(inf) == {"a"}
        rest.create(NODES, None, node("b"))
        rest.patch(NODES, None, "a", {"metadata": {"labels": {"x": "1"}}})
        rest.delete(NODES, None, "b")
        eventually(lambda: names(inf) == {"a"} and (inf.get("", "a") or {})["metadata"]["labels"] == {"x": "1"})
        assert changed.is_set()
    finally:
        inf.stop()


def test_a_dropped_watch_resumes_and_an_expired_one_relists(server: Any) -> None:
    rest = server.rest()
    inf = Informer(rest, NODES).start()
    try:
        assert inf.wait_synced(5)
        server.drop_watches()  # tried: the connection cut; the informer re-watches from its last version
        rest.create(NODES, None, node("after-drop"))
        eventually(lambda: "after-drop" in names(inf))
        inf._rest = _Blind(rest)  # type: ignore[assignment]  # tried: miss more events than the server keeps
        server.drop_watches()
        for i in range(12):
            rest.create(NODES, None, node(f"n{i}"))
        rest.delete(NODES, None, "after-drop")
        inf._rest = rest
        eventually(lambda: inf.relists >= 1 and names(inf) == {f"n{i}" for i in range(12)})
    finally:
        inf.stop()


class _Blind:
    """Watches that fail at once, so the informer falls behind the server's history."""

    def __init__(self, rest: Rest) -> None:
        self._rest = rest

    def list(self, *a: Any, **k: Any) -> Any:
        return self._rest.list(*a, **k)

    def watch(self, *a: Any, **k: Any) -> Iterator[Any]:
        from agent.kube.errors import ApiError

        time.sleep(0.05)
        raise ApiError(0, "blind")


def test_one_leader_and_a_standby_takes_over(server: Any) -> None:
    rest = server.rest()
    now = [1000.0]
    a = LeaderElector(rest, "kube-system", "arbiter", "a", clock=lambda: now[0])
    b = LeaderElector(rest, "kube-system", "arbiter", "b", clock=lambda: now[0])
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()  # a holds it and renewed just now
    now[0] += 5
    assert a.try_acquire_or_renew() and not b.try_acquire_or_renew()
    now[0] += 16  # a stopped renewing (killed): after the lease duration, b takes over
    assert b.try_acquire_or_renew()
    assert not a.try_acquire_or_renew()  # and a, back, does not take it from b
    lease = rest.get(LEASES, "kube-system", "arbiter")
    assert lease["spec"]["holderIdentity"] == "b" and lease["spec"]["leaseTransitions"] == 1
    b.release()
    assert a.try_acquire_or_renew()  # a released lease is free at once
