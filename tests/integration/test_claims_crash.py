"""kill -9 during a prepare/unprepare loop, many times: every restart (recover + retry) must converge.

A child process loops over prepare and unprepare batches, journaling each claim it saw prepared; the test
kills it with SIGKILL at a random moment, runs `recover()` as a restarting agent would, and checks: no
Started claim survives, every Completed claim has its CDI spec and no spec lacks one (no leaked file, no
temp file), no claim the child saw prepared is lost, and retrying every claim succeeds. The same trial runs
over consumable-capacity shares: every claim a share of one GPU, each its own CDI device.
"""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from agent.claims import cdi
from agent.claims.checkpoint import CheckpointStore, ClaimState
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.claims.types import ClaimRef
from tests.claim_sources import FileClaimSource
from tests.unit.test_claims_support import DRIVER, NODE, claim, inventory

REPO = pathlib.Path(__file__).resolve().parents[2]
KILLS = 30
DEVICES = ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4-mig-1g10gb-19-0", "gpu-4-mig-1g10gb-19-1"]
REFS = [ClaimRef("default", f"c{i}-uid", f"claim-{i}") for i in range(len(DEVICES))]


def make_preparer(root: pathlib.Path) -> ClaimPreparer:
    return ClaimPreparer(
        PrepareSettings(node_name=NODE, driver_name=DRIVER, inventory=inventory, mig_caps=cdi.MigCaps(lambda: None)),
        state_dir=root / "state",
        cdi_root=root / "cdi",
        source=FileClaimSource(root / "claims"),
        boot_id=lambda: "boot-1",
    )


def child(root: pathlib.Path, seed: int) -> None:
    """The agent under test: restart (recover), then prepare and unprepare random batches forever."""
    preparer = make_preparer(root)
    preparer.recover()
    rng = random.Random(seed)
    with open(root / "journal", "a", buffering=1) as journal:
        print("ready", flush=True)
        while True:
            batch = rng.sample(REFS, rng.randint(1, 3))
            for ref in batch:
                journal.write(f"preparing {ref.uid}\n")
            results = preparer.prepare(batch)
            for ref in batch:
                if results[ref.uid].error:
                    sys.exit(f"prepare {ref.uid}: {results[ref.uid].error}")
                journal.write(f"prepared {ref.uid}\n")
            batch = rng.sample(REFS, rng.randint(1, 3))
            for ref in batch:
                journal.write(f"unpreparing {ref.uid}\n")
            errors = preparer.unprepare(batch)
            for ref in batch:
                if errors[ref.uid]:
                    sys.exit(f"unprepare {ref.uid}: {errors[ref.uid]}")
                journal.write(f"unprepared {ref.uid}\n")


def last_journal_state(root: pathlib.Path) -> dict[str, str]:
    state: dict[str, str] = {}
    path = root / "journal"
    for line in path.read_text().splitlines() if path.exists() else ():
        what, uid = line.split()
        state[uid] = what
    return state


def check_converged(root: pathlib.Path) -> None:
    cp = CheckpointStore(root / "state", lambda: "boot-1").load()
    states = {uid: e.state for uid, e in cp.claims.items()}
    assert all(s is ClaimState.COMPLETED for s in states.values()), states
    cdi_files = {p.name for p in (root / "cdi").iterdir()} if (root / "cdi").exists() else set()
    assert cdi_files == {cdi.spec_file_name(uid) for uid in states}, "spec files and Completed claims differ"
    assert [p.name for p in (root / "state").rglob("*.tmp")] == []
    for uid in states:
        spec = yaml.safe_load((root / "cdi" / cdi.spec_file_name(uid)).read_text())
        names = [i.split("=", 1)[1] for d in cp.claims[uid].devices for i in d.cdi_device_ids]
        assert [d["name"] for d in spec["devices"]] == names
        assert all(
            n == cdi.cdi_name(uid, d.device_name, d.share_id)
            for n, d in zip(names, cp.claims[uid].devices, strict=True)
        )
    for uid, what in last_journal_state(root).items():
        if what == "prepared":
            assert uid in states, f"{uid} was prepared before the kill and is lost"
        if what == "unprepared":  # and no prepare of it started since
            assert uid not in states, f"{uid} was unprepared before the kill and came back"


def shared_claim(ref: ClaimRef) -> dict[str, object]:
    """A share of gpu-0 (10Gi of it), as kube-scheduler allocates consumable capacity."""
    body = claim(ref.uid, [], name=ref.name, namespace=ref.namespace)
    body["status"]["allocation"]["devices"]["results"] = [
        {
            "request": "gpu",
            "driver": DRIVER,
            "pool": NODE,
            "device": "gpu-0",
            "shareID": str(uuid.uuid5(uuid.NAMESPACE_OID, ref.uid)),
            "consumedCapacity": {"memory": "10Gi"},
        }
    ]
    return body


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "kills"), [("devices", KILLS), ("shares", KILLS // 2)])
def test_kill_minus_nine_at_random_points_always_recovers(tmp_path: pathlib.Path, layout: str, kills: int) -> None:
    for ref, device in zip(REFS, DEVICES, strict=True):
        (tmp_path / "claims" / ref.namespace).mkdir(parents=True, exist_ok=True)
        body = claim(ref.uid, [device], name=ref.name, namespace=ref.namespace)
        if layout == "shares":
            body = shared_claim(ref)
        (tmp_path / "claims" / ref.namespace / f"{ref.name}.json").write_text(json.dumps(body))

    rng = random.Random(1234)
    repaired = {"rolled_back": 0, "removed_specs": 0, "removed_temps": 0}
    for kill in range(kills):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.test_claims_crash", str(tmp_path), str(kill)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.communicate()[1]
        time.sleep(rng.uniform(0.001, 0.04))
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == -signal.SIGKILL, f"child ended by itself: {err}"

        recovery = make_preparer(tmp_path).recover()  # the restart
        repaired["rolled_back"] += len(recovery.rolled_back)
        repaired["removed_specs"] += len(recovery.removed_specs)
        repaired["removed_temps"] += recovery.removed_temps
        check_converged(tmp_path)

        # The kubelet retries: every claim prepares, the already-prepared ones from the checkpoint.
        results = make_preparer(tmp_path).prepare(REFS)
        assert {uid: r.error for uid, r in results.items() if r.error} == {}
        with open(tmp_path / "journal", "a") as journal:
            journal.writelines(f"prepared {ref.uid}\n" for ref in REFS)
        check_converged(tmp_path)

    assert len(last_journal_state(tmp_path)) == len(REFS)
    print(f"{kills} kills; repaired on restart: {repaired}")


if __name__ == "__main__":
    child(pathlib.Path(sys.argv[1]), int(sys.argv[2]))
