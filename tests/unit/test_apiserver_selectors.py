"""Label and field selector syntax of the API fake."""

from __future__ import annotations

import pytest

from fakes.apiserver.errors import ApiError
from fakes.apiserver.selectors import field_selector, label_selector


def obj(**labels: str) -> dict:
    return {"metadata": {"name": "n", "labels": labels}, "spec": {"nodeName": "node-a", "unschedulable": True}}


@pytest.mark.parametrize(
    ("selector", "matching"),
    [
        ("env=prod", {"prod"}),
        ("env==prod", {"prod"}),
        ("env!=prod", {"dev", "none"}),
        ("env in (prod, dev)", {"prod", "dev"}),
        ("env notin (prod)", {"dev", "none"}),
        ("env", {"prod", "dev"}),
        ("!env", {"none"}),
        ("env in (prod,dev),tier=web", {"prod"}),
        ("", {"prod", "dev", "none"}),
    ],
)
def test_label_selector(selector: str, matching: set[str]) -> None:
    objects = {"prod": obj(env="prod", tier="web"), "dev": obj(env="dev"), "none": obj()}
    match = label_selector(selector)
    assert {name for name, o in objects.items() if match(o)} == matching


@pytest.mark.parametrize("bad", ["env in prod", "a=b=c", "!env in (a)", "env notin"])
def test_label_selector_syntax_errors_are_400(bad: str) -> None:
    with pytest.raises(ApiError) as err:
        label_selector(bad)
    assert err.value.code == 400


def test_field_selector_known_fields_and_unsupported_one() -> None:
    assert field_selector("spec.nodeName=node-a,metadata.name!=x", ("spec.nodeName",))(obj())
    assert not field_selector("spec.nodeName==node-b", ("spec.nodeName",))(obj())
    assert field_selector("spec.unschedulable=true", ("spec.unschedulable",))(obj())
    # A field the type does not index is rejected like the real server does.
    with pytest.raises(ApiError) as err:
        field_selector("spec.nodeName=node-a", ())
    assert err.value.code == 400 and "field label not supported: spec.nodeName" in err.value.message
