"""`gpu-dra-agent inventory`: JSON for machines, a table for people, one clear line when NVML is absent."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from typing import Any

import pytest

from agent.cli import main
from agent.devices.names import GpuName, MigName, parse_device_name
from agent.nvml.errors import NvmlUnavailable
from agent.nvml.source import open_nvml


def inventory_json(capsys: pytest.CaptureFixture[str], machine: str) -> dict[str, Any]:
    assert main(["inventory", "--nvml", f"fake:{machine}", "--output", "json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


def test_dgx_h100_json_lists_eight_gpus_in_one_domain_with_25_placements(capsys: pytest.CaptureFixture[str]) -> None:
    doc = inventory_json(capsys, "dgx-h100")
    assert [g["name"] for g in doc["gpus"]] == [f"gpu-{i}" for i in range(8)]
    assert len({g["nvlinkDomain"] for g in doc["gpus"]}) == 1
    assert [d["gpus"] for d in doc["nvlinkDomains"]] == [[f"gpu-{i}" for i in range(8)]]
    for g in doc["gpus"]:
        assert g["uuid"].startswith("GPU-")
        assert g["productName"] == "NVIDIA H100 80GB HBM3"
        assert g["memoryBytes"] > 80 * 10**9
        assert g["migEnabled"] is False
        counts = Counter(p["profile"] for p in g["migPlacements"])
        assert counts == {
            "1g.10gb": 7,
            "1g.10gb+me": 7,
            "1g.20gb": 4,
            "2g.20gb": 3,
            "3g.40gb": 2,
            "4g.40gb": 1,
            "7g.80gb": 1,
        }
        for p in g["migPlacements"]:
            assert set(p) >= {"profile", "giProfileId", "start", "size"}
            name = parse_device_name(p["name"])
            assert name == MigName(
                g["minor"], p["profile"].replace(".", "").replace("+", "-"), p["giProfileId"], p["start"]
            )
    assert doc["migDevices"] == []


def test_h100_nvl_json_shows_two_domains(capsys: pytest.CaptureFixture[str]) -> None:
    doc = inventory_json(capsys, "h100-nvl-x4")
    assert sorted(d["gpus"] for d in doc["nvlinkDomains"]) == [["gpu-0", "gpu-1"], ["gpu-2", "gpu-3"]]
    by_name = {g["name"]: g for g in doc["gpus"]}
    assert by_name["gpu-0"]["nvlinkDomain"] == by_name["gpu-1"]["nvlinkDomain"] != by_name["gpu-2"]["nvlinkDomain"]


def test_mixed_mig_json_names_existing_mig_devices(capsys: pytest.CaptureFixture[str]) -> None:
    doc = inventory_json(capsys, "mixed-mig")
    assert len(doc["migDevices"]) == 8
    parents = {g["uuid"]: g for g in doc["gpus"]}
    for m in doc["migDevices"]:
        parent = parents[m["parentUUID"]]
        assert parent["migEnabled"] is True
        assert m["uuid"].startswith("MIG-")
        name = parse_device_name(m["name"])
        assert isinstance(name, MigName) and name.parent_minor == parent["minor"] and name.start == m["start"]
        assert isinstance(parse_device_name(m["parentName"]), GpuName)


def test_table_is_readable_at_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inventory", "--nvml", "fake:mixed-mig"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("Driver 550.54.15, CUDA 12.4, 4 GPU(s)")
    header = next(line for line in lines if line.startswith("NAME"))
    assert header.split()[:4] == ["NAME", "INDEX", "PRODUCT", "MEMORY"]
    assert sum(1 for line in lines if line.startswith("gpu-") and "NVIDIA H100 80GB HBM3" in line) == 4
    assert "MIG devices:" in out and "gpu-0-mig-3g40gb-9-" in out
    assert "NVLink domains:" in out
    assert max(len(line) for line in lines) < 200


def test_an_unknown_machine_is_one_line_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    # Tried: a fake machine that does not exist.
    assert main(["inventory", "--nvml", "fake:nope"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dgx-h100" in err and "Traceback" not in err


def test_a_malformed_nvml_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # Tried: --nvml with neither real nor fake:<machine>.
    with pytest.raises(SystemExit) as exit_:
        main(["inventory", "--nvml", "gpu0"])
    assert exit_.value.code == 2
    assert "fake:<machine>" in capsys.readouterr().err


def nvml_present() -> bool:
    try:
        with open_nvml("real"):
            return True
    except NvmlUnavailable:
        return False


def test_real_nvml_without_library_exits_with_one_sentence() -> None:
    if nvml_present():
        pytest.skip("this machine has NVML")
    # Tried: the real library on a machine without the NVIDIA driver; run as a user would, in a new process.
    proc = subprocess.run(
        [sys.executable, "-m", "agent.cli", "inventory", "--nvml", "real", "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr
    assert "libnvidia-ml.so.1" in proc.stderr


def test_inventory_shows_what_the_driver_root_provides(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    from fakes.nvml.binaries import install_driver_root

    root = tmp_path / "driver-root"
    install_driver_root(root)
    (root / "usr/bin/nvidia-debugdump").unlink()
    hook = root / "usr/bin/nvidia-cdi-hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    assert main(["inventory", "--nvml", "fake:dgx-h100", "--output", "json", "--driver-root", str(root)]) == 0
    files = json.loads(capsys.readouterr().out)["driverFiles"]
    assert files["version"] == "550.54.15"
    assert any(p.endswith("/libcuda.so.550.54.15") for p in files["libraries"])
    assert files["missing"] == ["nvidia-debugdump"]
    assert files["nvidiaCdiHook"] == "/usr/bin/nvidia-cdi-hook"
    assert main(["inventory", "--nvml", "fake:dgx-h100", "--driver-root", str(tmp_path / "empty")]) == 0
    table = capsys.readouterr().out
    assert "  libraries:   0: -" in table and "libcuda.so.550.54.15" in table.split("missing:")[1]
    assert "  hook:        not found" in table
    assert max(len(line) for line in table.splitlines()) < 200


def test_inventory_refuses_a_driver_root_of_another_version(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    from fakes.nvml.binaries import install_driver_root

    install_driver_root(tmp_path, version="535.104.05")
    assert main(["inventory", "--nvml", "fake:dgx-h100", "--driver-root", str(tmp_path)]) == 1
    assert "NVML reports driver 550.54.15" in capsys.readouterr().err


def test_a_fake_machine_shows_no_driver_files_unless_a_root_is_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tried on a GPU machine: `--nvml fake:...` read the host's / (driver 580.159.04) against the fake's 550.54.15
    # and exited 1. A fake machine's driver is not the host's, so its files come only from a root named for it.
    monkeypatch.delenv("NVIDIA_DRIVER_ROOT", raising=False)
    assert main(["inventory", "--nvml", "fake:dgx-h100", "--output", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["driverFiles"] is None
    assert main(["inventory", "--nvml", "fake:dgx-h100"]) == 0
    assert "Driver files: none shown (a fake machine; name its driver root with --driver-root)" in (
        capsys.readouterr().out
    )
