"""mig-parted v1 config files: the GPU Operator's default parses; what mig-parted refuses is refused here,
with a sentence naming the config and entry."""

from __future__ import annotations

import pathlib

import pytest

from agent.migconfig.files import load_mig_configs
from agent.migconfig.spec import DeviceFilter, InvalidMigConfig, parse_mig_configs

H100_SXM, A100_40GB = 0x233010DE, 0x20B010DE


def test_the_shipped_default_is_the_gpu_operators_config(shared_dir: pathlib.Path) -> None:
    shipped = load_mig_configs()
    operator = parse_mig_configs(
        (shared_dir / "data/mig/gpu-operator_default-mig-parted-config.config.yaml").read_text()
    )
    assert shipped == operator
    assert len(shipped.names()) == 81
    assert {"all-disabled", "all-enabled", "all-1g.10gb", "all-balanced"} <= set(shipped.names())


def test_all_1g10gb_splits_by_device_filter() -> None:
    entries = load_mig_configs().get("all-1g.10gb")
    assert entries is not None and len(entries) == 2
    big, small = entries
    assert big.mig_devices == (("1g.10gb", 7),) and small.mig_devices == (("1g.10gb", 4),)
    assert big.selects(0, H100_SXM) and not big.selects(0, A100_40GB)
    assert small.selects(5, A100_40GB) and not small.selects(5, H100_SXM)


def test_all_disabled_and_all_enabled() -> None:
    configs = load_mig_configs()
    (disabled,) = configs.get("all-disabled") or ()
    (enabled,) = configs.get("all-enabled") or ()
    assert (disabled.mig_enabled, disabled.mig_devices, disabled.devices) == (False, (), None)
    assert (enabled.mig_enabled, enabled.mig_devices) == (True, ())


def test_indexes_filters_with_subsystem_and_zero_counts() -> None:
    configs = parse_mig_configs(
        """
version: v1
mig-configs:
  custom:
    - device-filter: "0x233010DE:0x16C110DE"
      devices: [3, 1, 1]
      mig-enabled: true
      mig-devices: {"3g.40gb": 2, "1g.10gb": 0}
"""
    )
    (entry,) = configs.get("custom") or ()
    assert entry.devices == (1, 3)
    assert entry.device_filter == (DeviceFilter(H100_SXM, 0x16C110DE),)
    assert entry.mig_devices == (("3g.40gb", 2),)  # a zero count asks for nothing
    assert not entry.selects(0, H100_SXM)  # index 0 is not listed
    assert not entry.selects(1, H100_SXM)  # the subsystem id is unknown, so the filter does not match


ENTRY = "    - devices: all\n      mig-enabled: true\n      mig-devices: {}\n"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        pytest.param("version: v1\nmig-configs: [", "not valid YAML at line", id="not-yaml"),
        pytest.param("- a\n", "must be a mapping", id="a-list"),
        pytest.param("version: v2\nmig-configs:\n  a:\n" + ENTRY, "must say `version: v1`", id="version"),
        pytest.param("mig-configs:\n  a:\n" + ENTRY, "must say `version: v1`", id="no-version"),
        pytest.param("version: v1\nextra: 1\nmig-configs:\n  a:\n" + ENTRY, "unknown top-level keys", id="top-key"),
        pytest.param("version: v1\nmig-configs: {}\n", "at least one named config", id="no-configs"),
        pytest.param("version: v1\nmig-configs:\n  a: []\n", "config 'a' must be a non-empty list", id="empty-list"),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n      mig-device: {}\n",
            "config 'a' entry 0 has unknown keys ['mig-device']",
            id="typo-key",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - mig-enabled: false\n",
            "entry 0 is missing `devices`",
            id="no-devices",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n",
            "is missing `mig-enabled`",
            id="no-enabled",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: yes please\n",
            "mig-enabled must be true or false",
            id="enabled-not-bool",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n",
            "mig-devices is required",
            id="enabled-without-devices",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: false\n"
            '      mig-devices: {"1g.10gb": 7}\n',
            "mig-enabled is false but mig-devices lists instances",
            id="disabled-with-devices",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: some\n      mig-enabled: false\n",
            "devices must be `all` or a non-empty list",
            id="devices-word",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: [-1]\n      mig-enabled: false\n",
            "devices must be `all`",
            id="negative-index",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - device-filter: 0x2330\n      devices: all\n"
            "      mig-enabled: false\n",
            "device-filter",
            id="filter-not-string",
        ),
        pytest.param(
            'version: v1\nmig-configs:\n  a:\n    - device-filter: ["H100"]\n      devices: all\n'
            "      mig-enabled: false\n",
            "device-filter 'H100' is not a PCI id",
            id="filter-name",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n"
            '      mig-devices: {"1g.10gb": -1}\n',
            "needs a count >= 0",
            id="negative-count",
        ),
        pytest.param(
            "version: v1\nmig-configs:\n  a:\n    - devices: all\n      mig-enabled: true\n"
            '      mig-devices: {"1g.10gb": 0}\n',
            "counts are all 0",
            id="all-zero",
        ),
    ],
)
def test_invalid_files_are_one_sentence(text: str, says: str) -> None:
    with pytest.raises(InvalidMigConfig) as err:
        parse_mig_configs(text, "configs.yaml")
    message = str(err.value)
    assert says in message
    assert message.startswith("configs.yaml")
    assert "\n" not in message


def test_unreadable_file_names_the_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(InvalidMigConfig, match=r"--mig-config-file .*nope.yaml cannot be read: No such file"):
        load_mig_configs(missing)
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: v1\nmig-configs:\n  a: []\n")
    with pytest.raises(InvalidMigConfig, match=r"--mig-config-file .*bad.yaml: config 'a'"):
        load_mig_configs(bad)


def test_the_daemonset_mounts_the_same_configs_as_a_configmap() -> None:
    """daemonset/base/mig-parted-config.yaml holds the default configs; the DaemonSet points MIG_CONFIG_FILE at
    its mounted key, so a cluster edits the ConfigMap to offer its own layouts."""
    import yaml

    daemonset_dir = pathlib.Path(__file__).resolve().parents[2] / "daemonset" / "base"
    [configmap] = [d for d in yaml.safe_load_all((daemonset_dir / "mig-parted-config.yaml").read_text()) if d]
    assert parse_mig_configs(configmap["data"]["config.yaml"]) == load_mig_configs()
    [daemonset] = [
        d for d in yaml.safe_load_all((daemonset_dir / "daemonset.yaml").read_text()) if d and d["kind"] == "DaemonSet"
    ]
    pod = daemonset["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "mig-parted-config"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "mig-parted-config"]
    assert env["MIG_CONFIG_FILE"] == mount["mountPath"] + "/config.yaml"
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert configmap["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
