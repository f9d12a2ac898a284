"""The image `make image` builds, run by the real node: `ctr images import` of the test image's archive into the
node's containerd, then a pod of that image run by kubelet 1.37, containerd 2.4 and runc (the agent's
`inventory` on the NVML fake that the test layer adds). What is tried: the archive's index names the image as
kubelet resolves a manifest's `gpu-dra-agent:<tag>`, and the layers make a root runc can start the agent in.

Not yet here (issue 35, item 2): the DaemonSet from `helm install` as the node's agent (the node still runs the
agent as a host process). Real nodes on one machine share fixed host paths, so RealNode takes
~/.cache/gpu-dra-agent/real-node.lock for as long as it runs.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import CONTROL_PLANE_KEY, NODE_STACK_KEY, built_binaries
from tests.controlplane.cluster import ControlPlane, wait_for
from tests.node.images import builder
from tests.node.node import RealNode, real_node_lock

PODS = "/api/v1/namespaces/default/pods"

pytestmark = [
    pytest.mark.node,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(shutil.which("mmdebstrap") is None, reason="mmdebstrap is not installed (`make test` does)"),
]


@pytest.fixture(scope="module")
def node(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, RealNode]]:
    binaries = built_binaries(request, CONTROL_PLANE_KEY, "node tier")
    stack = built_binaries(request, NODE_STACK_KEY, "node tier")
    _, test_image = builder().build(out=tmp_path_factory.mktemp("image"))
    # the lock before the control plane starts (RealNode takes it again, nested)
    with real_node_lock(), ControlPlane(binaries).start() as cp, RealNode(cp, stack).start() as real:
        yield test_image, real


def test_containerd_imports_the_archive_and_runs_the_agent_in_a_pod(node: tuple[Any, RealNode]) -> None:
    image, real = node
    real.ctr("images", "import", str(image.path))
    listed = real.ctr("images", "ls", "-q")
    assert image.name in listed.split(), listed
    short = image.name.removeprefix("docker.io/library/")  # as a manifest names it
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "agent-image"},
        "spec": {
            "hostNetwork": True,
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "agent",
                    "image": short,
                    "imagePullPolicy": "Never",
                    "command": ["gpu-dra-agent", "inventory", "--nvml", "fake:dgx-h100", "--output", "json"],
                }
            ],
        },
    }
    real.cp.request("POST", PODS, pod)

    def finished() -> dict[str, Any] | None:
        current = real.cp.request("GET", f"{PODS}/agent-image")
        return current if current.get("status", {}).get("phase") in ("Succeeded", "Failed") else None

    try:
        done = wait_for("the image's pod to finish", finished, 180, alive=real.check_running)
    except AssertionError as error:
        raise AssertionError(f"{error}\nkubelet:\n{real.components['kubelet'].tail(30)}") from None
    (status,) = done["status"]["containerStatuses"]
    container = status["containerID"].split("://", 1)[1]
    output = real.crictl("logs", container)
    assert done["status"]["phase"] == "Succeeded", (json.dumps(status), output)
    gpus = json.loads(output)
    assert "H100" in json.dumps(gpus)
