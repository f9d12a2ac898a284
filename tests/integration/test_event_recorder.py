"""The Event recorder against the API fake: a repeated Event is one object whose count rises, also when the
server expired it meanwhile or the recorder forgot it (a restart, or more Events since than it remembers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import fakes.apiserver
from agent.kube import events
from agent.kube.events import EventRecorder
from agent.kube.rest import EVENTS

POD = {"metadata": {"name": "trainer", "namespace": "default", "uid": "u-1"}}


@pytest.fixture
def server() -> Iterator[fakes.apiserver.ApiServer]:
    with fakes.apiserver.start(port=0) as srv:
        yield srv


def written(server: fakes.apiserver.ApiServer, reason: str) -> list[dict[str, Any]]:
    return [e for e in server.store.objects("Event") if e["reason"] == reason]


def record(recorder: EventRecorder, reason: str, obj: dict[str, Any] = POD) -> None:
    recorder.record(obj, "Pod", "v1", reason, f"{reason} happened")
    assert recorder.flush()


def test_the_same_event_again_raises_its_count(server: fakes.apiserver.ApiServer) -> None:
    recorder = EventRecorder(server.rest(), "test", "here")
    record(recorder, "Waiting")
    record(recorder, "Waiting")
    [event] = written(server, "Waiting")
    assert event["count"] == 2 and event["involvedObject"]["uid"] == "u-1"


def test_an_event_the_server_expired_is_written_anew_with_its_count(server: fakes.apiserver.ApiServer) -> None:
    # Tried: the Event deleted between two recordings (the server keeps Events an hour). Before, the patch's 404
    # was logged and the Event was gone for good.
    recorder = EventRecorder(server.rest(), "test", "here")
    record(recorder, "Waiting")
    [event] = written(server, "Waiting")
    server.rest().delete(EVENTS, "default", event["metadata"]["name"])
    record(recorder, "Waiting")
    [again] = written(server, "Waiting")
    assert again["count"] == 2


def test_a_forgotten_event_is_read_back_and_counted_on(
    server: fakes.apiserver.ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tried: a restarted recorder, and one that has recorded more distinct Events than it keeps counts of
    # (bounded, so a long-running arbiter does not grow without end). Before, the counts were never let go.
    record(EventRecorder(server.rest(), "test", "before a restart"), "Waiting")
    restarted = EventRecorder(server.rest(), "test", "after")
    record(restarted, "Waiting")
    assert [e["count"] for e in written(server, "Waiting")] == [2]

    monkeypatch.setattr(events, "MAX_REMEMBERED", 3)
    recorder = EventRecorder(server.rest(), "test", "here")
    for i in range(5):
        record(recorder, "Seen", {"metadata": {"name": f"pod-{i}", "namespace": "default", "uid": f"u-{i}"}})
    assert len(recorder._counts) == 3  # the latest three
    record(recorder, "Seen", {"metadata": {"name": "pod-0", "namespace": "default", "uid": "u-0"}})
    counts = {e["involvedObject"]["name"]: e["count"] for e in written(server, "Seen")}
    assert counts == {"pod-0": 2, "pod-1": 1, "pod-2": 1, "pod-3": 1, "pod-4": 1}
