"""The allocation's `devices.config` as kube-scheduler 1.37.2 wrote it for the same claim on the real control
plane (tests/integration/test_allocation_config.py): FromClass first, one entry per class config naming every
request that used the class; FromClaim as written, dropped when it names only subrequests not chosen; no
`requests` where they cover the whole claim."""

from __future__ import annotations

from agent.objects.write import device_config
from tests.integration.test_allocation_config import CLAIM_CONFIG, CONFIGURED, opaque

CLASSES = {CONFIGURED: {"spec": {"config": [opaque("from-class")]}}, "gpu.nvidia.com": {"spec": {}}}
CLAIM = {
    "spec": {
        "devices": {
            "requests": [
                {
                    "name": "a",
                    "firstAvailable": [
                        {"name": "nine", "deviceClassName": CONFIGURED, "count": 9},
                        {"name": "one", "deviceClassName": CONFIGURED, "count": 1},
                    ],
                },
                {"name": "b", "exactly": {"deviceClassName": CONFIGURED}},
                {"name": "c", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
            ],
            "config": CLAIM_CONFIG,
        }
    }
}


def test_configs_for_the_subrequest_chosen_as_kube_scheduler_writes_them() -> None:
    assert device_config(CLAIM, CLASSES, (1, 0, 0)) == [
        {"source": "FromClass", "requests": ["a/one", "b"], **opaque("from-class")},
        {"source": "FromClaim", "requests": ["a/one"], **opaque("for-a-one")},
        {"source": "FromClaim", "requests": ["b", "c"], **opaque("for-b-and-c")},
        {"source": "FromClaim", **opaque("for-all")},
        {"source": "FromClaim", **opaque("names-all")},
    ]


def test_the_other_subrequest_takes_its_own_configs() -> None:
    written = device_config(CLAIM, CLASSES, (0, 0, 0))
    assert [c["opaque"]["parameters"]["kind"] for c in written] == [
        "from-class",
        "for-a-nine",
        "for-b-and-c",
        "for-all",
        "names-all",
    ]
    assert written[0]["requests"] == ["a/nine", "b"]
