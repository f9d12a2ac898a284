"""API failures reach the agent as agent.kube.errors types, whatever layer of the client raised them."""

from __future__ import annotations

import threading
import time

import pytest

from agent.kube import errors
from agent.kube.claims import KubeClaimSource
from agent.kube.client import BearerToken, Client, CredentialsError, Server
from agent.kube.rest import NODES, Rest
from agent.slices.publisher import Publisher
from tests.unit.test_slices_factory import dgx_h100


def unreachable_api() -> Rest:
    """A client pointed at a closed port: every call is refused at connect time."""
    return Rest(Client(Server("http://127.0.0.1:1")))


def test_an_unreachable_server_is_an_api_error_not_a_urllib3_one() -> None:
    with pytest.raises(errors.ApiError) as info:
        KubeClaimSource(unreachable_api()).get("default", "claim")
    assert info.value.status == 0
    assert "cannot reach the API server" in str(info.value)


def test_credentials_that_cannot_be_had_are_an_api_error_not_a_crash() -> None:
    """Tried: the token file of a running agent is gone when its token is due to be read again."""

    def gone() -> tuple[str, float | None]:
        raise CredentialsError("cannot read the token file /var/run/secrets/token: gone")

    rest = Rest(Client(Server("http://127.0.0.1:1"), BearerToken(gone)))
    with pytest.raises(errors.ApiError) as info:
        rest.get(NODES, None, "node-a")
    assert info.value.status == 0
    assert "no credentials for the API server" in str(info.value) and "token file" in str(info.value)


def test_http_statuses_map_to_their_error_types() -> None:
    for status, kind in ((404, errors.NotFound), (409, errors.Conflict), (410, errors.Gone), (422, errors.Invalid)):
        exc = errors.translate(status, b"", "x")
        assert type(exc) is kind and exc.status == status
    assert type(errors.translate(500, b"", "x")) is errors.ApiError


def test_the_resync_loop_outlives_an_unreachable_server() -> None:
    """Tried: publishing while the API server is down. The loop must keep trying (and report each failure):
    it is what repairs the slices once the server is back."""
    publisher = Publisher(unreachable_api(), "node-a", node_uid="uid-1", backoff_s=0.001)
    failures: list[Exception] = []
    stop = threading.Event()
    loop = threading.Thread(target=publisher.run, args=(stop, dgx_h100, 0.05), kwargs={"on_error": failures.append})
    loop.start()
    deadline = time.monotonic() + 10
    while len(failures) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.is_alive()
    stop.set()
    loop.join(timeout=5)
    assert len(failures) >= 3
    assert all(isinstance(f, errors.ApiError) and f.status == 0 for f in failures)


def test_an_api_error_reads_as_the_status_message_not_its_json() -> None:
    """Tried: a 403 with the server's usual Status body; the operator should read the sentence, not the JSON."""
    body = (
        '{"kind":"Status","apiVersion":"v1","metadata":{},"status":"Failure","message":"nodes \\"node-a\\" is '
        'forbidden: User \\"system:serviceaccount:x:y\\" cannot get resource \\"nodes\\"","reason":"Forbidden",'
        '"code":403}'
    )
    assert str(errors.translate(403, body.encode(), "Forbidden")) == (
        'API error 403: nodes "node-a" is forbidden: User "system:serviceaccount:x:y" cannot get resource "nodes"'
    )
    # not a Status: shown as sent
    html = errors.translate(403, b"<html>bad gateway</html>", "Forbidden")
    assert str(html) == "API error 403: <html>bad gateway</html>"
    assert str(errors.translate(403, b"", "Forbidden")) == "API error 403: Forbidden"
