"""The CDI edits of the driver's files: host vs container paths, read-only mounts, the nvidia-cdi-hook hooks,
and whole claim specs carrying them that validate against the CDI schema at the minimum cdiVersion."""

from __future__ import annotations

import json
import pathlib

from agent.claims import cdi
from agent.claims.cdi import CdiDevice, CdiStore
from agent.driver.discovery import discover
from agent.driver.edits import MOUNT_OPTIONS, SOCKET_OPTIONS, driver_edits, symlinks
from agent.driver.files import DriverFiles, File, Library
from fakes.nvml.binaries import install_driver_root
from fakes.nvml.driver_files import LIBRARIES, VERSION

HOOK = "/usr/bin/nvidia-cdi-hook"
LIB = "usr/local/nvidia/lib64"
FIRMWARE = f"lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"


def files() -> DriverFiles:
    return DriverFiles(
        version=VERSION,
        libraries=(
            Library(f"{LIB}/libcuda.so.{VERSION}", "libcuda.so.1", soname_link=True, dev_link=True),
            Library(f"{LIB}/libnvidia-ml.so.{VERSION}", "libnvidia-ml.so.1", soname_link=True, dev_link=False),
            Library(f"{LIB}/libnvidia-gpucomp.so.{VERSION}", f"libnvidia-gpucomp.so.{VERSION}", dev_link=True),
        ),
        binaries=(File("usr/bin/nvidia-smi", "opt/driver/bin/nvidia-smi"),),
        firmware=(File(FIRMWARE, FIRMWARE),),
        sockets=(File("run/nvidia-persistenced/socket", "run/nvidia-persistenced/socket"),),
    )


def test_mounts_go_from_the_host_driver_root_to_the_same_path_in_the_container() -> None:
    edits = driver_edits(files(), "/run/nvidia/driver", None)
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    cuda = mounts[f"/{LIB}/libcuda.so.{VERSION}"]
    assert cuda == {
        "hostPath": f"/run/nvidia/driver/{LIB}/libcuda.so.{VERSION}",
        "containerPath": f"/{LIB}/libcuda.so.{VERSION}",
        "options": ["ro", "nosuid", "nodev", "bind"],
    }
    # a binary reached through a link: mounted from the real file, where the container's PATH finds it
    assert mounts["/usr/bin/nvidia-smi"]["hostPath"] == "/run/nvidia/driver/opt/driver/bin/nvidia-smi"
    assert mounts[f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"]["options"] == list(MOUNT_OPTIONS)
    assert mounts["/run/nvidia-persistenced/socket"]["options"] == list(SOCKET_OPTIONS)  # writable: connect()
    assert "hooks" not in edits  # no hook binary: mounts only
    assert driver_edits(files(), "/", None)["mounts"][0]["hostPath"] == f"/{LIB}/libcuda.so.{VERSION}"


def test_hooks_make_the_links_and_the_loader_cache() -> None:
    hooks = driver_edits(files(), "/", HOOK)["hooks"]
    assert [h["args"][1] for h in hooks] == [
        "create-symlinks",
        "enable-cuda-compat",
        "update-ldcache",
        "disable-device-node-modification",
    ]
    assert all(
        h["hookName"] == "createContainer" and h["path"] == HOOK and h["args"][0] == "nvidia-cdi-hook" for h in hooks
    )
    links = hooks[0]["args"][2:]
    assert links[::2] == ["--link"] * (len(links) // 2)
    assert links[1::2] == [
        f"libcuda.so.1::/{LIB}/libcuda.so",  # always: programs dlopen("libcuda.so")
        f"libcuda.so.{VERSION}::/{LIB}/libcuda.so.1",
        f"libnvidia-ml.so.{VERSION}::/{LIB}/libnvidia-ml.so.1",  # its .so link is not on the root: not made
        f"libnvidia-gpucomp.so.{VERSION}::/{LIB}/libnvidia-gpucomp.so",
    ]
    assert hooks[1]["args"][2:] == [f"--host-driver-version={VERSION}"]
    assert hooks[2]["args"][2:] == ["--folder", f"/{LIB}"]
    assert symlinks(DriverFiles(VERSION)) == []
    assert driver_edits(DriverFiles(VERSION), "/", HOOK) == {}  # nothing found: nothing to mount or run


def test_a_claim_spec_written_with_the_driver_edits_is_complete_and_valid(
    tmp_path: pathlib.Path, shared_dir: pathlib.Path
) -> None:
    from tests.unit.test_claims_support import cdi_validator

    root = tmp_path / "driver-root"
    install_driver_root(root)
    edits = driver_edits(discover(root, VERSION), "/", HOOK)
    store = CdiStore(tmp_path / "cdi", edits)
    uid = "7e57e2f0-1111-2222-3333-444455556666"
    own = cdi.claim_spec(uid, [CdiDevice("gpu-0", "GPU-0", cdi.gpu_device_nodes(0))], "node-a", "gpu.nvidia.com")
    spec = json.loads(store.write(uid, own).read_text())  # JSON, as CDI reads it
    assert "mounts" not in own["containerEdits"]  # the checkpoint keeps only the claim's own part
    assert [e for e in cdi_validator(shared_dir).iter_errors(spec)] == []
    assert spec["cdiVersion"] == "0.5.0" == cdi.minimum_version(spec)  # a digit-led device name needs 0.5.0
    top = spec["containerEdits"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in top["env"]
    paths = {m["containerPath"] for m in top["mounts"]}
    lib_dir = next(p for p in paths if p.endswith(f"libcuda.so.{VERSION}")).rsplit("/", 1)[0]
    assert {f"{lib_dir}/{stem}.so.{VERSION}" for stem in LIBRARIES} <= paths
    assert {"/usr/bin/nvidia-smi", f"/lib/firmware/nvidia/{VERSION}/gsp_ga10x.bin"} <= paths
    assert [n["path"] for n in top["deviceNodes"]] == list(cdi.CONTROL_NODES)
    assert len(top["hooks"]) == 4
    with_mps = cdi.with_driver_edits(
        {
            **own,
            "containerEdits": {
                **own["containerEdits"],
                "mounts": [{"hostPath": "/run/mps", "containerPath": "/tmp/nvidia-mps"}],
            },
        },
        edits,
    )
    assert with_mps["containerEdits"]["mounts"][-1]["containerPath"] == "/tmp/nvidia-mps"  # the claim's own kept
    assert len(with_mps["containerEdits"]["mounts"]) == len(edits["mounts"]) + 1
