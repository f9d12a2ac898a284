"""What users read from the arbiter: each wait reason as an Event on the object it is about, Warning for a
problem, told again when it changes (numbers at most every WAIT_REFRESH_S); each left-out object told once."""

from __future__ import annotations

from typing import Any

from agent.arbiter.controller import WAIT_REFRESH_S, Arbiter
from agent.arbiter.validity import Invalid
from tests.unit.test_arbiter_world import claim, pod, pod_group, world


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str, str]] = []

    def record(self, obj: Any, kind: str, api_version: str, reason: str, message: str, *, type_: str) -> None:
        self.events.append((kind, obj["metadata"]["name"], reason, type_, message))


def arbiter() -> tuple[Arbiter, Recorder]:
    recorder = Recorder()
    a = Arbiter(rest=None, token="t", recorder=recorder)  # type: ignore[arg-type]  # nothing here calls the API
    return a, recorder


def test_a_lone_pod_is_told_on_itself_and_a_gang_on_its_pod_group() -> None:
    a, rec = arbiter()
    group = pod_group("train", 2)
    a.pod_groups._objects[("team-a", "train")] = group  # what the informer would hold
    w = world(
        [pod("alone", "c0"), pod("w0", "c1", group="train"), pod("w1", "c2", group="train")],
        [claim("c0"), claim("c1"), claim("c2")],
        [group],
    )
    a._tell_waiting(w, {"team-a/pod/alone": "no fit: x", "team-a/train": "no fit: y"}, now=0.0)
    assert sorted(e[:4] for e in rec.events) == [
        ("Pod", "alone", "Waiting", "Warning"),
        ("PodGroup", "train", "Waiting", "Warning"),
    ]


def test_a_reason_is_refreshed_when_it_changes() -> None:
    a, rec = arbiter()
    w = world([pod("p", "c0")], [claim("c0")])
    job = "team-a/pod/p"
    a._tell_waiting(w, {job: "waiting for the ResourceClaims of p (gpu) to be created from their templates"}, 0.0)
    a._tell_waiting(w, {job: "no fit: 4 free"}, 1.0)  # another kind of reason: told at once
    a._tell_waiting(w, {job: "no fit: 4 free"}, 2.0)  # the same: not again
    a._tell_waiting(w, {job: "no fit: 2 free"}, 3.0)  # new numbers, too soon
    a._tell_waiting(w, {job: "no fit: 2 free"}, 3.0 + WAIT_REFRESH_S)  # new numbers, refreshed
    assert [(e[3], e[4]) for e in rec.events] == [
        ("Normal", "waiting for the ResourceClaims of p (gpu) to be created from their templates"),
        ("Warning", "no fit: 4 free"),
        ("Warning", "no fit: 2 free"),
    ]


def test_an_object_left_out_is_told_once_per_reason() -> None:
    a, rec = arbiter()
    bad = {"metadata": {"name": "orphan"}, "spec": {"parentQueue": "gone"}}
    w = world([], [])
    for reason in ("invalid Queue: a", "invalid Queue: a", "invalid Queue: b"):
        w.invalid = {"Queue orphan": Invalid("Queue", bad, reason)}
        a._tell_invalid(w)
    assert [(e[0], e[2], e[3], e[4]) for e in rec.events] == [
        ("Queue", "Invalid", "Warning", "invalid Queue: a"),
        ("Queue", "Invalid", "Warning", "invalid Queue: b"),
    ]
