"""Patch formats of the API fake, applied directly: merge (RFC 7386), strategic merge, JSON patch (RFC 6902)."""

from __future__ import annotations

import pytest

from fakes.apiserver.errors import ApiError
from fakes.apiserver.patch import json_patch, merge_patch, strategic_merge_patch

POD = {
    "metadata": {"name": "p", "labels": {"a": "1", "b": "2"}, "finalizers": ["x/one"]},
    "spec": {
        "containers": [
            {"name": "main", "image": "v1", "env": [{"name": "A", "value": "1"}]},
            {"name": "side", "image": "s1"},
        ],
        "tolerations": [{"key": "k1"}],
    },
}


def test_merge_patch_replaces_lists_and_deletes_nulls() -> None:
    out = merge_patch(POD, {"metadata": {"labels": {"a": None, "c": "3"}}, "spec": {"tolerations": [{"key": "k2"}]}})
    assert out["metadata"]["labels"] == {"b": "2", "c": "3"}
    assert out["spec"]["tolerations"] == [{"key": "k2"}]
    assert out["spec"]["containers"] == POD["spec"]["containers"]
    assert POD["metadata"]["labels"] == {"a": "1", "b": "2"}  # the input is not changed


def test_strategic_merge_merges_containers_by_name_and_unions_finalizers() -> None:
    out = strategic_merge_patch(
        POD,
        {
            "metadata": {"finalizers": ["x/two"]},
            "spec": {"containers": [{"name": "main", "image": "v2"}, {"name": "new", "image": "n"}]},
        },
    )
    images = [(c["name"], c["image"]) for c in out["spec"]["containers"]]
    assert images == [("main", "v2"), ("side", "s1"), ("new", "n")]
    assert out["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    assert out["metadata"]["finalizers"] == ["x/one", "x/two"]


def test_strategic_merge_directives() -> None:
    out = strategic_merge_patch(
        POD,
        {
            "$setElementOrder/containers": [{"name": "main"}],
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["x/one"]},
            "spec": {"containers": [{"name": "side", "$patch": "delete"}], "tolerations": [{"key": "only"}]},
        },
    )
    assert [c["name"] for c in out["spec"]["containers"]] == ["main"]
    assert out["metadata"]["finalizers"] == []
    assert out["spec"]["tolerations"] == [{"key": "only"}]  # no merge key: replaced
    replaced = strategic_merge_patch(POD, {"metadata": {"labels": {"$patch": "replace", "z": "9"}}})
    assert replaced["metadata"]["labels"] == {"z": "9"}


def test_strategic_merge_rejects_a_list_element_without_its_merge_key() -> None:
    # A container without `name` cannot be matched.
    with pytest.raises(ApiError) as err:
        strategic_merge_patch(POD, {"spec": {"containers": [{"image": "x"}]}})
    assert err.value.code == 422


def test_json_patch_operations() -> None:
    out = json_patch(
        POD,
        [
            {"op": "add", "path": "/metadata/labels/new~1key", "value": "v"},
            {"op": "replace", "path": "/spec/containers/0/image", "value": "v9"},
            {"op": "remove", "path": "/metadata/labels/a"},
            {"op": "add", "path": "/metadata/finalizers/-", "value": "x/end"},
            {"op": "copy", "from": "/spec/containers/1", "path": "/spec/containers/-"},
            {"op": "move", "from": "/spec/tolerations", "path": "/spec/moved"},
            {"op": "test", "path": "/spec/containers/0/image", "value": "v9"},
        ],
    )
    assert out["metadata"]["labels"] == {"b": "2", "new/key": "v"}
    assert out["spec"]["containers"][0]["image"] == "v9"
    assert out["metadata"]["finalizers"] == ["x/one", "x/end"]
    assert [c["name"] for c in out["spec"]["containers"]] == ["main", "side", "side"]
    assert "tolerations" not in out["spec"] and out["spec"]["moved"] == [{"key": "k1"}]


@pytest.mark.parametrize(
    ("ops", "code"),
    [
        ([{"op": "test", "path": "/metadata/name", "value": "other"}], 422),  # a failing test op
        ([{"op": "remove", "path": "/metadata/nothing"}], 422),  # removing a missing member
        ([{"op": "replace", "path": "/spec/containers/7/image", "value": "x"}], 422),  # index out of range
        ([{"op": "frobnicate", "path": "/a"}], 400),  # unknown op
        ({"op": "add"}, 400),  # not a list
    ],
)
def test_json_patch_failures_reject_the_whole_patch(ops: object, code: int) -> None:
    with pytest.raises(ApiError) as err:
        json_patch(POD, ops)
    assert err.value.code == code
