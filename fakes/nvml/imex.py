"""Fake `nvidia-imex`: the IMEX daemon of a multi-node NVLink domain, as far as its supervisor can tell.

    nvidia-imex -c <imexd.cfg>

Like the real daemon it reads its config file (KEY=VALUE lines; IMEX_NODE_CONFIG_FILE names the nodes config, one
peer address a line), runs in the foreground (DAEMONIZE=0), reloads the nodes config on SIGUSR1 and exits 0 on
SIGTERM. It opens no network connection: instead of serving IMEX_CMD_PORT it records what it loaded in a status
file beside the config (`<config>.fake-imex.json`: pid, the config's settings, the nodes, when it is ready), which
the fake nvidia-imex-ctl reads. Tests read it too: it is what the running daemon loaded, not merely what was
written. A peer that is not an IP address in 127.0.0.0/8 is refused (test traffic stays on loopback), as a bad
address makes the real daemon exit.

FAKE_IMEX_READY_AFTER_S delays readiness (the real daemon takes a moment to start its listeners).
"""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

STATUS_SUFFIX = ".fake-imex.json"
READY_AFTER_ENV = "FAKE_IMEX_READY_AFTER_S"


def status_path(config: pathlib.Path) -> pathlib.Path:
    return config.with_name(config.name + STATUS_SUFFIX)


class ConfigError(ValueError):
    pass


def read_config(path: pathlib.Path) -> dict[str, str]:
    settings: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"{path}:{number}: not KEY=VALUE: {raw!r}")
        settings[key.strip()] = value.strip()
    return settings


def read_nodes(path: pathlib.Path) -> list[str]:
    nodes = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            address = ipaddress.ip_address(line)
        except ValueError:
            raise ConfigError(f"{path}: {line!r} is not an IP address") from None
        if not address.is_loopback:
            raise ConfigError(f"{path}: {line} is not a loopback address (the fake reaches no other host)")
        nodes.append(line)
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{path}: a node is listed twice: {nodes}")
    return nodes


def _write(path: pathlib.Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "-c":
        print("usage: nvidia-imex -c <config file>", file=sys.stderr)
        return 2
    config = pathlib.Path(args[1])
    status = status_path(config)
    try:
        settings = read_config(config)
        nodes_file = settings.get("IMEX_NODE_CONFIG_FILE", "")
        nodes = read_nodes(pathlib.Path(nodes_file)) if nodes_file else None
    except (OSError, ConfigError) as exc:
        print(f"nvidia-imex: {exc}", file=sys.stderr)
        return 1
    if nodes is None:
        print(f"nvidia-imex: {config}: IMEX_NODE_CONFIG_FILE is not set", file=sys.stderr)
        return 1
    ready_at = time.time() + float(os.environ.get(READY_AFTER_ENV) or 0)
    reloads = 0
    stop = threading.Event()
    reload = threading.Event()

    def record() -> None:
        _write(
            status,
            {
                "pid": os.getpid(),
                "config": str(config),
                "settings": settings,
                "nodesFile": nodes_file,
                "nodes": nodes,
                "readyAt": ready_at,
                "reloads": reloads,
            },
        )

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGUSR1, lambda *_: reload.set())
    record()
    print(f"nvidia-imex (fake): serving {len(nodes)} node(s): {', '.join(nodes)}", flush=True)
    while not stop.wait(0.05):
        if reload.is_set():
            reload.clear()
            try:
                nodes = read_nodes(pathlib.Path(nodes_file))
            except (OSError, ConfigError) as exc:
                print(f"nvidia-imex: reload: {exc}", file=sys.stderr)
                continue
            reloads += 1
            record()
    status.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
