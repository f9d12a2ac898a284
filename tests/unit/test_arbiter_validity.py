"""No single bad object stops the arbiter's cycle: an invalid Queue, PodGroup, pod or claim is left out of the
snapshot with its reason, and everything else is decided as if it were not there."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.arbiter.core.cycle import run_cycle
from agent.arbiter.queue_status import queue_statuses
from agent.arbiter.validity import queue_spec, valid_queues
from agent.arbiter.waiting import wait_reasons
from tests.unit.test_arbiter_world import claim, pod, pod_group, queue, world


def healthy(extra_queues: list[Any] = (), groups: list[Any] = (), pods: list[Any] = (), claims: list[Any] = ()) -> Any:
    """A top-level queue `ok` with a gated 1-GPU pod, beside whatever else is given; 16 GPUs free."""
    return world(
        [pod("want", "c-want", queue_name="ok"), *pods],
        [claim("c-want"), *claims],
        list(groups),
        queues=[queue("ok", gpu_quota=1), *extra_queues],
    )


def admitted(w: Any) -> bool:
    return run_cycle(w.snapshot).pods["team-a/want"].action == "bind"


def test_a_queue_whose_parent_does_not_exist_stops_nothing() -> None:
    # the reported case: every cycle failed with KeyError: 'no-such-parent' and nothing was admitted
    w = healthy([queue("orphan", "no-such-parent", 4), queue("orphan-child", "orphan")])
    assert admitted(w)
    assert w.invalid["Queue orphan"].reason == "invalid Queue: its parentQueue no-such-parent does not exist"
    assert w.invalid["Queue orphan-child"].reason == "invalid Queue: its parentQueue orphan is invalid"
    assert {q.name for q in w.snapshot.queues} == {"ok"}


def test_a_cycle_in_the_queue_tree_is_left_out() -> None:
    w = healthy([queue("a", "b"), queue("b", "c"), queue("c", "a"), queue("under", "a")])
    assert admitted(w)
    assert "is a cycle" in w.invalid["Queue a"].reason and "a -> b -> c -> a" in w.invalid["Queue a"].reason
    assert w.invalid["Queue under"].reason == "invalid Queue: its parentQueue a is invalid"


@pytest.mark.parametrize(
    ("resources", "reason"),
    [
        ({"gpu": {"quota": -5}}, "spec.resources.gpu.quota must be -1 (unlimited) or 0 or more, not -5"),
        ({"gpu": {"limit": -0.5}}, "spec.resources.gpu.limit must be -1 (unlimited) or 0 or more, not -0.5"),
        ({"cpu": {"overQuotaWeight": -1}}, "spec.resources.cpu.overQuotaWeight must be 0 or more, not -1"),
        ({"memory": {"quota": "lots"}}, "spec.resources.memory.quota must be a number, not 'lots'"),
        ({"gpu": "eight"}, "spec.resources.gpu must be an object"),
    ],
)
def test_invalid_values_are_refused_with_the_field_named(resources: dict[str, Any], reason: str) -> None:
    bad = {"metadata": {"name": "bad"}, "spec": {"resources": resources}}
    with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        queue_spec(bad)
    # and a pod in that queue waits, saying why, while the healthy queue's pod is admitted
    w = healthy([bad], pods=[pod("p", "c-p", queue_name="bad")], claims=[claim("c-p")])
    assert admitted(w)
    assert w.waiting["team-a/pod/p"] == f"queue bad is left out: invalid Queue: {reason}"


def test_minus_one_is_unlimited_and_zero_is_valid() -> None:
    spec = queue_spec(
        {"metadata": {"name": "q"}, "spec": {"resources": {"gpu": {"quota": -1, "limit": 0, "overQuotaWeight": 0}}}}
    )
    assert (spec.terms[0].quota, spec.terms[0].limit, spec.terms[0].over_quota_weight) == (-1, 0, 0)


def test_a_bad_duration_or_priority_is_refused() -> None:
    _, invalid = valid_queues(
        [
            {"metadata": {"name": "q"}, "spec": {"preemptMinRuntime": "soon"}},
            {"metadata": {"name": "r"}, "spec": {"priority": "high"}},
        ]
    )
    assert "preemptMinRuntime must be a Go duration" in invalid["q"].reason
    assert "priority must be an integer" in invalid["r"].reason


def test_an_invalid_pod_group_leaves_out_its_gang_only() -> None:
    bad = pod_group("broken", 2)
    bad["spec"]["schedulingPolicy"]["gang"]["minCount"] = "two"
    w = healthy(groups=[bad], pods=[pod("b0", "c-b0", group="broken", queue_name="ok")], claims=[claim("c-b0")])
    assert admitted(w)
    assert "minCount must be a whole number" in w.invalid["PodGroup team-a/broken"].reason
    assert w.waiting["team-a/broken"].startswith("PodGroup broken is invalid")


def test_a_malformed_pod_or_claim_is_reported_not_fatal() -> None:
    odd = pod("odd", "c-odd", queue_name="ok")
    odd["spec"]["priority"] = "urgent"
    broken_claim = claim("c-bc")
    broken_claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = "many"
    w = healthy(pods=[odd, pod("bc", "c-bc", queue_name="ok")], claims=[claim("c-odd"), broken_claim])
    assert admitted(w)
    assert "spec.priority must be an integer" in w.invalid["Pod team-a/odd"].reason
    assert "cannot read this claim" in w.invalid["ResourceClaim team-a/c-bc"].reason


def test_a_running_gang_left_out_still_holds_its_devices() -> None:
    # its queue lost its parent: the gang is not weighed, but its 2 GPUs on n0 are not free for anyone else
    running = pod("r", "held", gated=False, node_name="n0", queue_name="orphan")
    w = healthy([queue("orphan", "gone")], pods=[running], claims=[claim("held", 2, "n0", ("gpu-0", "gpu-1"), "r")])
    assert {n.name: n.gpus for n in w.snapshot.nodes} == {"n0": 6, "n1": 8}
    assert admitted(w)


# -- property: arbitrary Queues and PodGroups never stop the cycle ------------------------------------------

_NAMES = ["q0", "q1", "q2", "q3", "q4"]
_anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_amount = st.one_of(st.sampled_from([-1, 0, 1, 8, -5, 0.5, -0.5]), _anything)
_terms = st.one_of(
    st.fixed_dictionaries({}, optional={"quota": _amount, "limit": _amount, "overQuotaWeight": _amount}), _anything
)
_spec = st.fixed_dictionaries(
    {},
    optional={
        "parentQueue": st.one_of(st.sampled_from([*_NAMES, "missing", ""]), _anything),
        "priority": st.one_of(st.integers(0, 200), _anything),
        "preemptMinRuntime": st.one_of(st.sampled_from(["5m", "1h30m", "bogus"]), _anything),
        "reclaimMinRuntime": st.one_of(st.sampled_from(["30s", "x"]), _anything),
        "resources": st.one_of(
            st.fixed_dictionaries({}, optional={"gpu": _terms, "cpu": _terms, "memory": _terms}), _anything
        ),
    },
)
_queues = st.lists(
    st.tuples(st.sampled_from(_NAMES), st.one_of(_spec, _anything)), max_size=6, unique_by=lambda t: t[0]
)
_group_spec = st.one_of(
    _anything,
    st.fixed_dictionaries(
        {},
        optional={
            "priority": st.one_of(st.integers(-5, 200), _anything),
            "schedulingPolicy": st.one_of(
                _anything,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "gang": st.one_of(
                            _anything,
                            st.fixed_dictionaries({}, optional={"minCount": st.one_of(st.integers(-2, 4), _anything)}),
                        )
                    },
                ),
            ),
        },
    ),
)
_groups = st.lists(
    st.tuples(st.sampled_from(["g0", "g1", "g2"]), _group_spec, st.sampled_from(_NAMES)),
    max_size=3,
    unique_by=lambda t: t[0],
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_queues, _groups)
def test_arbitrary_queues_and_pod_groups_never_stop_the_cycle(queues: Any, groups: Any) -> None:
    queue_objs = [{"metadata": {"name": n}, "spec": spec} for n, spec in queues]
    group_objs = [
        {
            "metadata": {
                "name": g,
                "namespace": "team-a",
                "labels": {"scheduling.gpu-dra-agent.io/queue": q},
                "creationTimestamp": "2027-01-15T07:00:00Z",
            },
            "spec": spec,
        }
        for g, spec, q in groups
    ]
    members = [pod(f"{g}-m", f"c-{g}", group=g, queue_name=None) for g, _, _ in groups]
    w = healthy(queue_objs, group_objs, members, [claim(f"c-{g}") for g, _, _ in groups])
    result = run_cycle(w.snapshot)  # never raises
    wait_reasons(w.snapshot, result)
    queue_statuses(w.snapshot, result)
    assert result.pods["team-a/want"].action == "bind"  # the healthy queue goes on
    names = {q.name for q in w.snapshot.queues}
    assert all(q.parent is None or q.parent in names for q in w.snapshot.queues)
    assert names | {k.removeprefix("Queue ") for k in w.invalid if k.startswith("Queue ")} >= {n for n, _ in queues}
