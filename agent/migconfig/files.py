"""Reading `--mig-config-file`, or the GPU Operator's default configs shipped with the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from agent.migconfig.spec import InvalidMigConfig, MigConfigs, parse_mig_configs

DEFAULT_CONFIG = "default-mig-parted-config.yaml"


def load_mig_configs(path: str | Path | None = None) -> MigConfigs:
    """The configs of `path`, or the GPU Operator's default when None.

    Raises:
        InvalidMigConfig: the file cannot be read or is not a valid mig-parted v1 file (one sentence).
    """
    if path is None:
        text = resources.files("agent.migconfig").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8")
        return parse_mig_configs(text, "the default MIG config")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise InvalidMigConfig(f"--mig-config-file {path} cannot be read: {reason}") from exc
    return parse_mig_configs(text, f"--mig-config-file {path}")
