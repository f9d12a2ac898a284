"""A leader paused past its Lease writes nothing once it resumes (issue 33, item 4).

Tried: two arbiters with short Lease timings; the leader stopped with SIGSTOP while it commits a burst, the
standby takes the Lease, the old leader resumes with SIGCONT. Before every write the leader checks that its
last renewal is within the renew deadline on the monotonic clock; before that check it went on with its
commits (claims and ungates) after the takeover. The longer trial: tests/bench/test_trials_arbiter.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fakes.cluster import FakeCluster
from tests.bench.test_trials_arbiter import paused_leader_trial

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster() -> Iterator[FakeCluster]:
    with FakeCluster(nodes=2) as c:
        c.queue("root")
        c.queue("team-a", parent="root", gpu_quota=16)
        yield c


def test_a_leader_resumed_after_losing_the_lease_writes_nothing(cluster: FakeCluster) -> None:
    result = paused_leader_trial(cluster, "paused", lease_s=3.0, renew_s=2.0, retry_s=0.5, pause_s=5.0)
    assert result["writes after takeover"] == []
    assert result["exit code"] == 1  # it saw it had lost the Lease and exited, to start over as a standby
    assert sum(result["damage"].values()) == 0, result["damage"]
