"""The one reflector both the node agent and the arbiter run on: a field-selected list and watch, bookmarks
that move the resume version on while nothing selected changes, a stop that cuts a silent watch at once, and
a callback's failure answered by a fresh list."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import fakes.apiserver
from agent.kube import informer, nodes, slices
from agent.kube.backoff import Backoff
from agent.kube.reflector import Reflector
from agent.kube.rest import NODES


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def node(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}


def test_bookmarks_advance_the_version_and_stop_cuts_a_silent_watch() -> None:
    with fakes.apiserver.start(port=0, bookmark_interval=0.1) as server:
        rest = server.rest()
        rest.create(NODES, None, node("mine"))
        listed: list[list[str]] = []
        events: list[tuple[str, str]] = []
        reflector = Reflector(
            rest,
            NODES,
            lambda items: listed.append([o["metadata"]["name"] for o in items]),
            lambda kind, obj: events.append((kind, obj["metadata"]["name"])),
            field_selector="metadata.name=mine",
            watch_timeout_s=600,
        )
        reflector.start()
        eventually(lambda: listed == [["mine"]])
        first = reflector.resource_version
        for i in range(3):  # changes the selector hides: only bookmarks tell the reflector time moved on
            rest.create(NODES, None, node(f"other-{i}"))
        eventually(lambda: int(reflector.resource_version) > int(first))
        assert events == []
        rest.patch(NODES, None, "mine", {"metadata": {"labels": {"a": "b"}}})
        eventually(lambda: events == [("MODIFIED", "mine")])
        started = time.monotonic()
        reflector.stop()
        assert time.monotonic() - started < 2.0  # the watch would otherwise run for 600 s
        assert reflector.stopped


def test_a_failing_callback_is_answered_with_a_fresh_list() -> None:
    with fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        lists = threading.Semaphore(0)
        failed = threading.Event()

        def on_event(kind: str, obj: dict[str, Any]) -> None:
            if not failed.is_set():
                failed.set()
                raise RuntimeError("a bug in a handler")

        reflector = Reflector(rest, NODES, lambda items: lists.release(), on_event, backoff=Backoff(0.01, 0.05))
        reflector.start()
        assert lists.acquire(timeout=10)
        rest.create(NODES, None, node("n"))
        assert lists.acquire(timeout=10)  # listed again after the failure
        assert reflector.relists == 1
        reflector.stop()


def test_node_agent_and_arbiter_watch_through_the_same_reflector() -> None:
    with fakes.apiserver.start(port=0) as server:
        watcher = nodes.NodeWatcher(server.rest(), "n")
        slice_watch = slices.watch_changes(server.rest(), "n", "gpu.nvidia.com", lambda kind, name: None)
        arbiter_side = informer.Informer(server.rest(), NODES)
        assert isinstance(watcher._watch, Reflector)
        assert isinstance(slice_watch, Reflector)
        assert isinstance(arbiter_side._reflector, Reflector)


def test_a_lingering_watch_reads_a_burst_through_and_pauses_only_when_drained() -> None:
    """What is tried: 300 nodes made before a watch opens from the version before them, so the server sends them
    as one burst, the watch lingering 0.2 s. A pause after each event would take a minute: it pauses only
    once it has read all that was sent. Then, idle, it pauses, and sees a change made meanwhile."""
    with fakes.apiserver.start(port=0) as server:
        rest = server.rest()
        before = rest.list(NODES)["metadata"]["resourceVersion"]
        for i in range(300):
            rest.create(NODES, None, node(f"n{i}"))
        seen: list[str] = []
        pauses: list[int] = []  # how many events had been read at each pause

        def pause(seconds: float) -> None:
            pauses.append(len(seen))
            time.sleep(seconds)

        events = rest.watch(NODES, before, timeout_seconds=60, linger_s=0.2, pause=pause)
        started = time.monotonic()
        for event in events:
            seen.append(event.object["metadata"]["name"])
            if len(seen) == 300:
                break
        assert seen == [f"n{i}" for i in range(300)]
        assert time.monotonic() - started < 10
        assert len(pauses) < 30, pauses  # only while the server was still writing the burst, not one per event
        late = threading.Timer(0.5, lambda: rest.create(NODES, None, node("late")))
        late.start()
        assert next(events).object["metadata"]["name"] == "late"
        assert pauses[-1] == 300  # idle once the burst was read: it paused before reading on
        events.close()
        late.join()


def test_drained_over_tls_sees_bytes_held_by_the_reader_and_by_the_socket(tmp_path: Any) -> None:
    """What is tried: a TLS server sends two chunks in one record, then nothing, then a third. After the first is
    read the second waits in the response's buffer (not drained); after the second nothing is left (drained,
    found by a read that would block under TLS); once the third is sent the socket has it (not drained)."""
    import socket
    import ssl

    from agent.kube.client import Client, Server, drained
    from tests.controlplane.pki import make_pki

    pki = make_pki(tmp_path)
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(pki.serving_cert, pki.serving_key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    third = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        with serving.wrap_socket(conn, server_side=True) as tls:
            while b"\r\n\r\n" not in tls.recv(65536):
                pass
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            tls.sendall(head + b"4\r\none\n\r\n" + b"4\r\ntwo\n\r\n")
            third.wait(10)
            tls.sendall(b"6\r\nthree\n\r\n0\r\n\r\n")
            time.sleep(0.5)

    server_thread = threading.Thread(target=serve, daemon=True)
    server_thread.start()
    trust = ssl.create_default_context(cafile=str(pki.ca_cert))
    client = Client(Server(f"https://127.0.0.1:{port}", trust))
    response = client.stream("GET", "/watch")
    chunks = response.stream(64 * 1024, decode_content=False)
    assert next(chunks) == b"one\n"
    assert not drained(response)  # "two" came in the same record: buffered
    assert next(chunks) == b"two\n"
    assert drained(response)
    third.set()
    eventually(lambda: not drained(response))
    assert next(chunks) == b"three\n"
    response.release_conn()
    server_thread.join(5)
    listener.close()
