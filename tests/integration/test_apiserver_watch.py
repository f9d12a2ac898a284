"""Watches through kubernetes.watch.Watch: resume, bookmarks, selectors, 410 Gone, dropped connections."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import urllib3
from kubernetes import client, watch
from kubernetes.client import ApiException

import fakes.apiserver
from fakes.apiserver import ApiServer


@pytest.fixture
def server() -> Iterator[ApiServer]:
    with fakes.apiserver.start(history=5, bookmark_interval=0.1) as s:
        yield s


@pytest.fixture
def core(server: ApiServer) -> client.CoreV1Api:
    return client.CoreV1Api(server.api_client())


def cm(name: str, **labels: str) -> dict:
    return {"metadata": {"name": name, "labels": labels}, "data": {"k": name}}


def test_watch_resumes_after_a_resource_version(core: client.CoreV1Api) -> None:
    core.create_namespaced_config_map("default", cm("before"))
    listed = core.list_namespaced_config_map("default")
    core.create_namespaced_config_map("default", cm("after"))
    core.patch_namespaced_config_map("after", "default", {"data": {"k": "changed"}})
    core.delete_namespaced_config_map("after", "default")
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_config_map,
            "default",
            resource_version=listed.metadata.resource_version,
            timeout_seconds=1,
        )
    ]
    assert seen == [("ADDED", "after"), ("MODIFIED", "after"), ("DELETED", "after")]


def test_watch_without_version_starts_with_current_objects_then_streams(core: client.CoreV1Api) -> None:
    core.create_namespaced_config_map("default", cm("existing"))
    w = watch.Watch()
    seen: list[tuple[str, str]] = []
    for event in w.stream(core.list_namespaced_config_map, "default", timeout_seconds=5):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 1:
            core.create_namespaced_config_map("default", cm("new"))
        else:
            w.stop()
    assert seen == [("ADDED", "existing"), ("ADDED", "new")]


def test_bookmarks_carry_the_latest_resource_version(core: client.CoreV1Api) -> None:
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_pod(
        "default", {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "i"}]}}
    )  # another type moves the global resourceVersion on
    w = watch.Watch()
    for event in w.stream(
        core.list_namespaced_config_map, "default", resource_version=rv, allow_watch_bookmarks=True, timeout_seconds=3
    ):
        assert event["type"] == "BOOKMARK"
        assert int(event["raw_object"]["metadata"]["resourceVersion"]) > int(rv)
        w.stop()
    assert int(w.resource_version) > int(rv)


def test_label_and_field_selectors_filter_watch_events(core: client.CoreV1Api) -> None:
    rv = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", cm("a", team="x"))
    core.create_namespaced_config_map("default", cm("b", team="y"))
    core.patch_namespaced_config_map("b", "default", {"metadata": {"labels": {"team": "x"}}})
    core.patch_namespaced_config_map("a", "default", {"metadata": {"labels": {"team": "z"}}})
    seen = [
        (e["type"], e["object"].metadata.name)
        for e in watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=rv, label_selector="team=x", timeout_seconds=1
        )
    ]
    # b entering the selection is an ADDED, a leaving it a DELETED, as the real server reports.
    assert seen == [("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a")]
    only_b = [
        e["object"].metadata.name
        for e in watch.Watch().stream(
            core.list_namespaced_config_map,
            "default",
            resource_version=rv,
            field_selector="metadata.name=b",
            timeout_seconds=1,
        )
    ]
    assert only_b == ["b", "b"]


def test_expired_resource_version_is_410(server: ApiServer, core: client.CoreV1Api) -> None:
    old = core.list_namespaced_config_map("default").metadata.resource_version
    for i in range(8):  # more changes than the 5 events of history
        core.create_namespaced_config_map("default", cm(f"c{i}"))
    # kubernetes.watch retries a 410 once by itself; a timeout disables that, so the error reaches us.
    with pytest.raises(ApiException) as err:
        list(watch.Watch().stream(core.list_namespaced_config_map, "default", resource_version=old, timeout_seconds=1))
    assert err.value.status == 410 and "too old resource version" in err.value.reason
    # A version inside the window still resumes.
    recent = server.store.resource_version - 2
    assert (
        len(
            list(
                watch.Watch().stream(
                    core.list_namespaced_config_map, "default", resource_version=str(recent), timeout_seconds=1
                )
            )
        )
        == 2
    )


def test_drop_watches_cuts_open_streams(server: ApiServer, core: client.CoreV1Api) -> None:
    started = threading.Event()
    outcome: list[object] = []

    def consume() -> None:
        try:
            for _ in watch.Watch().stream(
                core.list_namespaced_config_map,
                "default",
                resource_version=str(server.store.resource_version),
                timeout_seconds=30,
                _request_timeout=30,
            ):
                pass
            outcome.append("ended")
        except (urllib3.exceptions.HTTPError, ApiException) as exc:
            outcome.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    started.wait(0.3)
    server.drop_watches()
    reader.join(timeout=5)
    assert not reader.is_alive() and outcome, "the watch should end as soon as watches are dropped"
