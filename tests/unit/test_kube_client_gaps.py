"""agent.kube's client where it used to fall short of client-go: a server's Retry-After, a client-side rate limit,
proxies from the environment, a slow exec plugin, a burst of watch events, and kubeconfig settings it cannot
honour. Each is tried against a local HTTP server on loopback or with the clock and sleep passed in."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from agent.kube import rest
from agent.kube.client import BearerToken, Client, RateLimiter, Server
from agent.kube.kubeconfig import KubeconfigError, from_files, proxy_from_environment


class _Busy(http.server.BaseHTTPRequestHandler):
    """Answers 429 with Retry-After `retry_after` to the first `busy` requests, then 200; records paths."""

    busy = 2
    retry_after = "1"
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        type(self).seen.append(self.path)
        status = 429 if len(type(self).seen) <= type(self).busy else 200
        body = b'{"kind": "Status"}' if status == 429 else b"{}"
        self.send_response(status)
        if status == 429:
            self.send_header("Retry-After", type(self).retry_after)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def busy_server() -> Iterator[str]:
    _Busy.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_429_with_retry_after_is_waited_out_and_tried_again(busy_server: str) -> None:
    # tried: the first two answers are 429 "Retry-After: 1"; before, the caller got the first 429 as an error
    waits: list[float] = []
    client = Client(Server(busy_server), sleep=waits.append)
    response = client.request("GET", "/api/v1/pods")
    assert response.status == 200
    assert waits == [1.0, 1.0] and len(_Busy.seen) == 3


def test_a_retry_after_too_long_is_capped_and_attempts_end(busy_server: str) -> None:
    _Busy.busy, _Busy.retry_after = 100, "3600"
    try:
        waits: list[float] = []
        response = Client(Server(busy_server), sleep=waits.append).request("GET", "/x")
        assert response.status == 429  # given up after ten attempts, the last answer returned as it is
        assert len(_Busy.seen) == 10 and waits == [10.0] * 9
    finally:
        _Busy.busy, _Busy.retry_after = 2, "1"


def test_without_retries_a_429_is_returned_at_once(busy_server: str) -> None:
    waits: list[float] = []
    response = Client(Server(busy_server), sleep=waits.append).request("GET", "/x", retries=False)
    assert response.status == 429 and waits == [] and len(_Busy.seen) == 1


def test_the_rate_limit_lets_a_burst_through_then_spaces_requests() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(round(seconds, 6))
        now[0] += seconds

    limit = RateLimiter(qps=10, burst=3, clock=lambda: now[0], sleep=sleep)
    for _ in range(5):
        limit.wait()
    assert slept == [0.1, 0.1]  # three at once, then one every 1/qps


def test_the_rate_limit_is_applied_to_every_request(busy_server: str) -> None:
    _Busy.busy = 0
    try:
        waited: list[int] = []

        class Counting(RateLimiter):
            def wait(self) -> None:
                waited.append(1)

        client = Client(Server(busy_server), rate_limit=Counting(qps=1, burst=1))
        for _ in range(3):
            client.request("GET", "/x")
        assert len(waited) == 3
    finally:
        _Busy.busy = 2


@pytest.mark.parametrize(
    ("url", "env", "proxy"),
    [
        ("https://api.example:6443", {"HTTPS_PROXY": "http://proxy:3128"}, "http://proxy:3128"),
        ("https://api.example:6443", {"https_proxy": "proxy:3128"}, "http://proxy:3128"),
        ("http://api.example:8080", {"HTTPS_PROXY": "http://proxy:3128"}, None),
        ("http://api.example:8080", {"HTTP_PROXY": "http://proxy:3128"}, "http://proxy:3128"),
        ("https://api.example:6443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": ".example"}, None),
        ("https://api.example:6443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "api.example"}, None),
        ("https://10.96.0.1:443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "10.96.0.0/12"}, None),
        ("https://[fd00::1]:443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "fd00::/8"}, None),
        ("https://10.97.0.1:443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "10.96.0.0/16"}, "http://p:1"),
        ("https://api.example:6443", {"HTTPS_PROXY": "http://p:1", "NO_PROXY": "*"}, None),
    ],
)
def test_proxies_come_from_the_environment_as_client_go_reads_them(
    url: str, env: dict[str, str], proxy: str | None
) -> None:
    assert proxy_from_environment(url, env) == proxy


def _kubeconfig(tmp_path: Path, cluster: dict[str, object], user: dict[str, object]) -> Path:
    path = tmp_path / "config"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1", **cluster}}],
                "users": [{"name": "u", "user": user}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
            }
        )
    )
    return path


def test_a_kubeconfig_takes_its_proxy_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:3128")
    client = from_files([_kubeconfig(tmp_path, {}, {"token": "t"})])
    assert client.server.proxy_url == "http://127.0.0.1:3128"
    client = from_files([_kubeconfig(tmp_path, {"proxy-url": "http://127.0.0.1:8888"}, {"token": "t"})])
    assert client.server.proxy_url == "http://127.0.0.1:8888"  # the kubeconfig's own wins


@pytest.mark.parametrize(
    ("cluster", "user", "words"),
    [
        ({}, {"token": "t", "as": "someone"}, "'as' (impersonation)"),
        ({}, {"token": "t", "as-groups": ["g"]}, "'as-groups' (impersonation)"),
        ({}, {"token": "t", "as-uid": "1"}, "'as-uid' (impersonation)"),
        ({"disable-compression": True}, {"token": "t"}, "disable-compression"),
        (
            {},
            {"exec": {"command": "true", "apiVersion": "client.authentication.k8s.io/v1", "provideClusterInfo": True}},
            "provideClusterInfo",
        ),
    ],
)
def test_settings_the_client_would_ignore_are_refused(
    tmp_path: Path, cluster: dict[str, object], user: dict[str, object], words: str
) -> None:
    with pytest.raises(KubeconfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_files([_kubeconfig(tmp_path, cluster, user)])


def test_a_slow_token_refresh_does_not_hold_up_requests_that_have_a_token() -> None:
    # tried: the second read blocks (an exec plugin taking its time); before, every request waited on the lock
    # held across it, for up to a minute
    release, reading = threading.Event(), threading.Event()
    reads = iter(["first", "second"])

    def read() -> tuple[str, float | None]:
        token = next(reads)
        if token == "second":
            reading.set()
            release.wait(10)
        return token, None

    auth = BearerToken(read, max_age_s=0.0)  # stale at once: every request wants a new one
    assert auth.headers() == {"Authorization": "Bearer first"}
    refresher = threading.Thread(target=auth.headers)
    refresher.start()
    assert reading.wait(5)
    others: list[object] = []
    other = threading.Thread(target=lambda: others.append(auth.headers()))
    other.start()
    other.join(2)
    done_while_reading = not other.is_alive()
    release.set()
    refresher.join(5)
    other.join(5)
    assert done_while_reading and others == [{"Authorization": "Bearer first"}]


def test_a_refused_token_makes_requests_wait_for_the_new_one() -> None:
    tokens = iter(["old", "new"])
    auth = BearerToken(lambda: (next(tokens), None), max_age_s=3600)
    assert auth.headers()["Authorization"] == "Bearer old"
    auth.rejected()
    assert auth.headers()["Authorization"] == "Bearer new"


def _naive(chunks: list[bytes]) -> list[bytes]:
    data = b"".join(chunks)
    return [line for line in data.split(b"\n") if line.strip()]


@given(
    st.lists(st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")), max_size=30),
    st.lists(st.integers(min_value=0, max_value=400), max_size=12),
)
def test_watch_lines_are_the_same_however_the_stream_is_cut(lines: list[bytes], cuts: list[int]) -> None:
    data = b"\n".join(lines) + b"\n"
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert list(rest._lines(iter(chunks))) == _naive(chunks)
