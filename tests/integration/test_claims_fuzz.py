"""Hostile input over the real DRA socket: NodePrepareResources and NodeUnprepareResources with claims of
arbitrary names, namespaces and UIDs, allocations of arbitrary device names, pools and drivers, and arbitrary
opaque configs. Whatever comes in, the agent answers every claim (an error is that claim's, never the call's),
writes no file outside its CDI root and state dir, never prepares a device for two claims that may not share
it, and still serves a good claim afterwards.

`make test` runs a modest number of examples; set CLAIMS_FUZZ_EXAMPLES for more (e.g. 2000 before a release).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent._proto.kubelet import dra_v1_pb2 as pb
from agent._proto.kubelet import dra_v1_pb2_grpc as pb_grpc
from agent.claims import cdi
from agent.claims.checkpoint import CheckpointStore, ClaimState
from agent.claims.preparer import ClaimPreparer
from agent.claims.settings import PrepareSettings
from agent.devices.names import canonical
from agent.kubelet import KubeletPlugin
from tests.claim_sources import StaticClaimSource
from tests.unit.test_claims_support import API_VERSION, DRIVER, NODE, claim, inventory

EXAMPLES = int(os.environ.get("CLAIMS_FUZZ_EXAMPLES", "30"))

# Text from anywhere, and text that looks almost right (so examples also reach the deeper checks).
hostile = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="abc-./\\\0\n 0123456789", max_size=20),
    st.sampled_from(["", ".", "..", "x/../y", "../../etc/passwd", "a\0b", "u" * 300, "default", "uid-1"]),
)
uids = st.one_of(st.sampled_from(["uid-1", "uid-2", "uid-3"]), hostile)
devices = st.one_of(
    st.sampled_from(
        [
            "gpu-0",
            "gpu-1",
            "gpu-01",
            "gpu-001",
            "gpu-3",
            "gpu-4",
            "gpu-9",
            "gpu--1",
            "GPU-0",
            "gpu-4-mig-1g10gb-19-0",
            "gpu-4-mig-1g10gb-19-00",
            "gpu-4-mig-1g10gb-19-1",
            "gpu-0-mig-1g10gb-19-0",
            "gpu-4-mig-7g80gb-0-0",
        ]
    ),
    hostile,
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=10)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8,
)
sharing = st.one_of(
    st.fixed_dictionaries({"strategy": st.sampled_from(["TimeSlicing", "MPS", "None", ""])}),
    st.fixed_dictionaries(
        {"strategy": st.just("MPS")},
        optional={
            "mpsConfig": st.dictionaries(
                st.sampled_from(
                    [
                        "defaultActiveThreadPercentage",
                        "defaultPinnedDeviceMemoryLimit",
                        "defaultPerDevicePinnedMemoryLimit",
                        "bogus",
                    ]
                ),
                st.one_of(
                    json_values,
                    st.dictionaries(
                        st.one_of(st.sampled_from(["0", "1", "\u00b2", "GPU-x"]), st.text(max_size=5)),
                        st.one_of(st.sampled_from(["1Gi", "9" * 500]), json_values),
                        max_size=2,
                    ),
                ),
                max_size=3,
            )
        },
    ),
    json_values,
)
parameters = st.one_of(
    st.fixed_dictionaries(
        {
            "apiVersion": st.sampled_from([API_VERSION, "v1"]),
            "kind": st.sampled_from(["GpuConfig", "MigDeviceConfig", "X"]),
        },
        optional={"sharing": sharing},
    ),
    json_values,
)
configs = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {
                "opaque": st.fixed_dictionaries(
                    {"driver": st.sampled_from([DRIVER, "other.example.com"]), "parameters": parameters}
                )
            },
            optional={
                "source": st.sampled_from(["FromClaim", "FromClass", "Nowhere"]),
                "requests": st.one_of(st.lists(st.sampled_from(["gpu", "r"]), max_size=2), json_values),
            },
        ),
        json_values,
    ),
    max_size=2,
)
results = st.lists(
    st.fixed_dictionaries(
        {
            "request": st.sampled_from(["gpu", "r", "gpu/sub"]),
            "device": devices,
            "driver": st.sampled_from([DRIVER, DRIVER, "other.example.com"]),
            "pool": st.sampled_from([NODE, NODE, "node-b"]),
        },
        optional={"adminAccess": st.booleans(), "shareID": st.sampled_from(["", "s1", "s2"])},
    ),
    max_size=3,
)


@st.composite
def claims(draw: st.DrawFn) -> tuple[pb.Claim, dict[str, Any] | None]:
    """A claim as the kubelet names it, and the ResourceClaim the API holds for it (None: not found)."""
    ref = pb.Claim(
        namespace=draw(st.one_of(st.just("default"), hostile)),
        uid=draw(uids),
        name=draw(st.one_of(st.sampled_from(["c1", "c2"]), hostile)),
    )
    kind = draw(st.sampled_from(["allocated", "allocated", "other uid", "unallocated", "missing", "garbage"]))
    if kind == "missing":
        return ref, None
    body = claim(ref.uid, name=ref.name, namespace=ref.namespace, allocated=kind != "unallocated")
    if kind == "other uid":
        body["metadata"]["uid"] = "someone-else"
    if "allocation" in body["status"]:
        body["status"]["allocation"]["devices"] = {"results": draw(results), "config": draw(configs)}
    if kind == "garbage":
        body["status"] = draw(json_values)
    return ref, body


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if not p.is_dir()}


@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    st.lists(
        st.tuples(st.sampled_from(["prepare", "unprepare"]), st.lists(claims(), min_size=1, max_size=4)),
        min_size=1,
        max_size=4,
    )
)
def test_hostile_prepare_and_unprepare_requests_stay_per_claim(
    calls: list[tuple[str, list[tuple[pb.Claim, dict[str, Any] | None]]]],
) -> None:
    with _node() as (root, source, stub):
        outside_before = files_under(root.parent / f"{root.name}-outside")
        for method, batch in calls:
            for ref, body in batch:
                if body is not None:
                    source.claims[(ref.namespace, ref.name)] = body
            request_type = pb.NodePrepareResourcesRequest if method == "prepare" else pb.NodeUnprepareResourcesRequest
            response = getattr(stub, f"Node{method.capitalize()}Resources")(
                request_type(claims=[ref for ref, _ in batch]), timeout=30
            )  # a batch error would raise grpc.RpcError here
            assert set(response.claims) == {ref.uid for ref, _ in batch}, "a claim got no answer"
            for ref, _ in batch:
                entry = response.claims[ref.uid]
                # Neither a failure of the whole batch (the node's own state) nor an unexpected exception.
                assert not entry.error.startswith(("cannot prepare:", "cannot unprepare:")), entry.error
                assert "internal error" not in entry.error and "failed:" not in entry.error, entry.error
                if method == "prepare" and not entry.error:
                    assert entry.devices, f"claim {ref.uid!r} prepared with no device"
            _check_no_device_prepared_twice(root / "state")
            stray = {
                p
                for p in files_under(root)
                if not p.is_relative_to(root / "cdi")
                and not p.is_relative_to(root / "state")
                and not p.is_relative_to(root / "kubelet")
            }
            assert stray == set(), f"files outside the CDI root and state dir: {stray}"
            assert files_under(root.parent / f"{root.name}-outside") == outside_before
            for path in files_under(root / "cdi"):
                assert path.name.startswith(cdi.spec_file_name("").removesuffix(cdi.SUFFIX)), path

        # Still serving: a good claim on a free GPU prepares and unprepares.
        good = pb.Claim(namespace="default", uid="good-uid", name="good")
        source.claims[("default", "good")] = claim("good-uid", ["gpu-2"], name="good", request="gpu")
        held = CheckpointStore(root / "state", lambda: "boot-1").load()
        taken = {canonical(d.device_name) for e in held.claims.values() for d in e.devices}
        if "gpu-2" not in taken:
            prepared = stub.NodePrepareResources(pb.NodePrepareResourcesRequest(claims=[good]), timeout=30)
            assert prepared.claims["good-uid"].error == ""
        unprepared = stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(claims=[good]), timeout=30)
        assert unprepared.claims["good-uid"].error == ""


def _check_no_device_prepared_twice(state_dir: Path) -> None:
    """Two claims hold one device only where prepare lets them share: admin access, distinct shares, or
    TimeSlicing/MPS of the same strategy in both."""
    cp = CheckpointStore(state_dir, lambda: "boot-1").load()
    holders: dict[str, list[Any]] = {}
    for entry in cp.claims.values():
        assert entry.state is ClaimState.COMPLETED, f"claim {entry.uid!r} left {entry.state}"
        for device in entry.devices:
            holders.setdefault(canonical(device.device_name), []).append(device)
    for name, held in holders.items():
        exclusive = [d for d in held if not d.admin_access and not d.share_id]
        if len(exclusive) > 1:
            strategies = {d.sharing for d in exclusive}
            assert len(strategies) == 1 and "" not in strategies, f"device {name} prepared for several claims"


class _node:
    """A node agent's claim side on a real DRA socket, in a fresh directory (an `-outside` sibling holds a
    file that must survive whatever path a claim UID names)."""

    def __enter__(self) -> tuple[Path, StaticClaimSource, Any]:
        self.root = Path(tempfile.mkdtemp(prefix="fz-", dir="/tmp"))  # short: unix socket paths are limited
        outside = self.root.parent / f"{self.root.name}-outside"
        outside.mkdir()
        (outside / "precious.yaml").write_text("keep")
        self.source = StaticClaimSource()
        preparer = ClaimPreparer(
            PrepareSettings(
                node_name=NODE,
                driver_name=DRIVER,
                inventory=inventory,
                mig_caps=cdi.MigCaps(lambda: None),
            ),
            state_dir=self.root / "state",
            cdi_root=self.root / "cdi",
            source=self.source,
            boot_id=lambda: "boot-1",
            lock_timeout=5,
        )
        self.plugin = KubeletPlugin(DRIVER, self.root / "kubelet", preparer)
        self.plugin.start()
        self.channel = grpc.insecure_channel(f"unix://{self.plugin.dra_socket}")
        return self.root, self.source, pb_grpc.DRAPluginStub(self.channel)

    def __exit__(self, *exc: object) -> None:
        self.channel.close()
        self.plugin.stop(grace=0)
        shutil.rmtree(self.root.parent / f"{self.root.name}-outside", ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)
