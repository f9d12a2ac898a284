"""Table cells the API fake computes as upstream's printers do."""

from __future__ import annotations

import datetime

import pytest

from fakes.apiserver.resources import ResourceType
from fakes.apiserver.tables import human_duration, table, wants_table


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "<invalid>"),
        (0, "0s"),
        (119, "119s"),
        (125, "2m5s"),
        (600, "10m"),
        (3 * 3600 + 60, "3h1m"),
        (30 * 3600, "30h"),
        (3 * 86400 + 3600, "3d1h"),
        (40 * 86400, "40d"),
        (3 * 365 * 86400, "3y"),
    ],
)
def test_human_duration_matches_apimachinery(seconds: int, text: str) -> None:
    assert human_duration(seconds) == text


def test_custom_columns_follow_json_paths_and_dates() -> None:
    now = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.UTC)
    rt = ResourceType(
        "example.com",
        "v1",
        "things",
        "Thing",
        True,
        builtin=False,
        columns=(
            {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
            {"name": "First", "type": "string", "jsonPath": ".spec.items[0]"},
            {"name": "Seen", "type": "date", "jsonPath": ".status.seen"},
            {"name": "Missing", "type": "integer", "jsonPath": ".spec.nothing"},
        ),
    )
    obj = {
        "metadata": {"name": "t"},
        "spec": {"items": ["x", "y"]},
        "status": {"seen": "2026-11-23T11:00:00Z", "conditions": [{"type": "Ready", "status": "True"}]},
    }
    out = table(rt, [obj], now=now)
    assert [c["name"] for c in out["columnDefinitions"]] == ["Name", "Ready", "First", "Seen", "Missing"]
    assert out["rows"][0]["cells"] == ["t", "True", "x", "60m", None]


def test_accept_headers_that_ask_for_tables() -> None:
    assert wants_table("application/json;as=Table;v=v1;g=meta.k8s.io,application/json")
    assert not wants_table("application/json;as=Table;v=v1beta1;g=meta.k8s.io")
    assert not wants_table("application/json")
