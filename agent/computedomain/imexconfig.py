"""The IMEX daemon's two config files, rendered without I/O.

`imexd.cfg` holds NVIDIA's compute-domain daemon settings (its template's keys and values): foreground, no
authentication, the command port bound to this node's address, quorum waited for only in recovery, and the nodes
file. `nodes.cfg` lists the peers of one IMEX domain, one address a line: the domain's nodes in this node's clique.
"""

from __future__ import annotations

from collections.abc import Sequence

SERVER_PORT = 50000
CMD_PORT = 50005


def daemon_config(nodes_config_path: str, bind_address: str) -> str:
    settings = {
        "LOG_LEVEL": "4",
        "LOG_FILE_NAME": "",
        "LOG_APPEND_TO_LOG": "0",
        "LOG_USE_SYSLOG": "0",
        "DAEMONIZE": "0",  # the agent supervises it
        "BIND_INTERFACE_IP": "",
        "SERVER_PORT": str(SERVER_PORT),
        "IMEX_NODE_CONFIG_FILE": nodes_config_path,
        "IMEX_WAIT_FOR_QUORUM": "RECOVERY",
        "IMEX_ENABLE_AUTH_ENCRYPTION": "0",
        "IMEX_CMD_ENABLED": "1",
        "IMEX_CMD_BIND_INTERFACE_IP": bind_address,
        "IMEX_CMD_PORT": str(CMD_PORT),
        "IMEX_NODE_DISCONNECTED_GRACE_TIME": "-1",
    }
    return "# written by gpu-dra-agent for one ComputeDomain's IMEX daemon on this node\n" + "".join(
        f"{k}={v}\n" for k, v in settings.items()
    )


def nodes_config(peers: Sequence[str]) -> str:
    return "".join(f"{p}\n" for p in peers)


def is_ready(ctl_output: str) -> bool:
    """nvidia-imex-ctl -q says READY and nothing else (NVIDIA's daemon compares the output byte for byte)."""
    return ctl_output == "READY\n"
