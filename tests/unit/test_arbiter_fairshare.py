"""Fair share: KAI's proportion division, worked examples and invariants."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from agent.arbiter.core.fairshare import Claim, divide, fair_shares
from agent.arbiter.core.model import MILLI, QueueSpec, ResourceTerms
from tests.unit.test_arbiter_support import cycle, doc, gang, node, queue

G = MILLI


def claim(
    quota: float, request: float, weight: float = 1, limit: float = -1, priority: int = 100, order: int = 0
) -> Claim:
    return Claim(quota=quota, limit=limit, weight=weight, priority=priority, request=request, order=order)


def test_reference_worked_example_rounds_whole_gpus_and_gives_the_leftover_to_the_largest_remainder() -> None:
    # scheduling.md: 8 GPUs, q0 quota 4 w4 req 7, q1 quota 2 w2 req 3 -> 5 and 3
    shares = divide(8 * G, [claim(4 * G, 7 * G, 4, order=0), claim(2 * G, 3 * G, 2, order=1)], G)
    assert shares == [5 * G, 3 * G]


def test_quota_is_capped_by_demand_and_the_rest_goes_over_quota_by_weight() -> None:
    # q0 wants only 1 of its quota 4; 11 remain for q1 (w1) and q2 (w2): offers 3.67 and 7.33 round down
    # to 3 and 7, and the leftover unit goes to the larger remainder (q1, 0.67)
    shares = divide(12 * G, [claim(4 * G, 1 * G), claim(0, 20 * G, 1, order=1), claim(0, 20 * G, 2, order=2)], G)
    assert shares == [1 * G, 4 * G, 7 * G]


def test_a_satisfied_queue_returns_the_rest_for_another_round() -> None:
    # 10 over quota, equal weights: q0 needs 2 (satisfied), q1 then takes the other 8
    assert divide(10 * G, [claim(0, 2 * G), claim(0, 50 * G, order=1)], G) == [2 * G, 8 * G]


def test_higher_priority_band_is_served_over_quota_first() -> None:
    shares = divide(10 * G, [claim(0, 10 * G, priority=100), claim(0, 10 * G, priority=200, order=1)], G)
    assert shares == [0, 10 * G]


def test_weight_zero_gets_nothing_beyond_quota() -> None:
    assert divide(10 * G, [claim(2 * G, 10 * G, weight=0), claim(0, 3 * G, order=1)], G) == [2 * G, 3 * G]


def test_limit_caps_the_share_even_with_idle_capacity() -> None:
    assert divide(10 * G, [claim(0, 10 * G, limit=4 * G)], G) == [4 * G]


def test_unlimited_quota_means_the_whole_level() -> None:
    assert divide(6 * G, [claim(-1, 9 * G, weight=0)], G) == [6 * G]


def test_oversubscribed_quotas_are_not_scaled_down() -> None:
    # KAI resource_division.go setDeservedResource: each child deserves min(quota, requestable) even when
    # the quotas add up to more than the level has; nothing is then left over quota
    shares = divide(4 * G, [claim(3 * G, 3 * G, priority=100), claim(3 * G, 5 * G, priority=150, order=1)], G)
    assert shares == [3 * G, 3 * G]


def test_usage_shifts_only_the_over_quota_division() -> None:
    # time-aware fair share (KAI calcShareWeights): equal weights, but q0 used 60 % of the cluster lately and q1
    # nothing: weights become max(0, w + k (w - usage)) = 0.4 and 1.0; the quota part (2 each) never moves
    hungry = [claim(2 * G, 20 * G, order=0), claim(2 * G, 20 * G, order=1)]
    used = [
        Claim(c.quota, c.limit, c.weight, c.priority, c.request, c.order, usage=u)
        for c, u in zip(hungry, (0.6, 0.0), strict=True)
    ]
    assert divide(12 * G, hungry, G) == [6 * G, 6 * G]
    shares = divide(12 * G, used, G)
    assert shares[0] >= 2 * G and shares[1] >= 2 * G
    assert shares == [4 * G, 8 * G]  # 8 over quota as 0.4 : 1.0 -> 2.29 and 5.71 -> 2 and 5, the last unit to q1


def test_ties_on_remainders_go_to_the_older_queue() -> None:
    # 3 GPUs over quota, 2 equal queues: 1 each whole, the last unit to the older queue (order 0)
    assert divide(3 * G, [claim(0, 9 * G, order=0), claim(0, 9 * G, order=1)], G) == [2 * G, 1 * G]


def test_fractional_demand_is_given_exactly() -> None:
    assert divide(2 * G, [claim(0, 500), claim(0, 250, order=1)], G) == [500, 250]


def test_children_divide_their_parent_share_and_parent_limits_cap_the_subtree() -> None:
    terms = (ResourceTerms(0, -1, 1), ResourceTerms(), ResourceTerms())
    capped = (ResourceTerms(0, 4 * G, 1), ResourceTerms(), ResourceTerms())
    queues = [
        QueueSpec("a", None, 100, capped),
        QueueSpec("a1", "a", 100, terms),
        QueueSpec("a2", "a", 100, terms),
        QueueSpec("b", None, 100, terms),
    ]
    demand = {"a1": (8.0 * G, 0.0, 0.0), "a2": (8.0 * G, 0.0, 0.0), "b": (20.0 * G, 0.0, 0.0)}
    shares = fair_shares(queues, demand, (16.0 * G, 100.0, 100.0))
    assert shares["a"][0] == 4 * G
    assert shares["a1"][0] + shares["a2"][0] == 4 * G
    assert shares["b"][0] == 12 * G


def test_fair_share_in_a_cycle_counts_running_and_pending_demand() -> None:
    result = cycle(
        doc(
            [node("n", gpus=8)],
            [queue("a", quota=2), queue("b", quota=2)],
            [gang("ja", "a", 6, node=None), gang("jb", "b", 1)],
        ),
        "allocate",
    )
    assert result.fair_share["b"][0] == 1 * G  # demand-capped
    assert result.fair_share["a"][0] == 6 * G  # quota 2 + over quota 4 (b needs no more)


claims = st.lists(
    st.builds(
        Claim,
        quota=st.one_of(st.just(-1.0), st.floats(0, 20)),
        limit=st.one_of(st.just(-1.0), st.floats(0, 20)),
        weight=st.one_of(st.just(-1.0), st.floats(0, 5)),
        priority=st.sampled_from([50, 100, 150]),
        request=st.floats(0, 30),
        order=st.integers(0, 100),
    ),
    max_size=8,
)


def _deserved(amount: float, c: Claim) -> float:
    return min(amount if c.quota == -1 else c.quota, c.requestable)


@settings(max_examples=300, deadline=None)
@given(amount=st.floats(0, 50), claims=claims)
# a denormal weight alone: pool * weight / weight rounded to more than the pool (1 of 0.75 left was given)
@example(
    amount=23.0,
    claims=[
        Claim(-1.0, -1.0, -1.0, 50, 17.0, 0),
        Claim(-1.0, -1.0, -1.0, 50, 2.5, 0),
        Claim(-1.0, -1.0, -1.0, 50, 2.75, 0),
        Claim(0.0, -1.0, 5e-324, 50, 1.0, 0),
    ],
)
def test_each_queue_gets_its_deserved_part_and_only_the_rest_is_divided_over_quota(
    amount: float, claims: list[Claim]
) -> None:
    shares = divide(amount, claims, 1.0)
    deserved = [_deserved(amount, c) for c in claims]
    over = sum(shares) - sum(deserved)
    assert over <= max(0.0, amount - sum(deserved)) + 1e-6  # quotas are not scaled down; the rest is shared
    for share, d, c in zip(shares, deserved, claims, strict=True):
        assert d - 1e-9 <= share <= c.requestable + 1e-6


@settings(max_examples=200, deadline=None)
@given(amount=st.integers(0, 40), claims=claims)
def test_no_gpu_is_left_idle_while_a_weighted_queue_still_wants_one(amount: int, claims: list[Claim]) -> None:
    shares = divide(float(amount), claims, 1.0)
    hungry = [c.requestable - s for s, c in zip(shares, claims, strict=True) if c.weight != 0]
    if amount - sum(shares) >= 1 - 1e-6:
        assert all(h <= 1e-6 for h in hungry)
