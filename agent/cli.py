"""`gpu-dra-agent` command line: one subcommand per module under agent.commands.

Each command module defines `add_arguments(parser)` and `run(args) -> int`; it is imported only when
its command runs, so `inventory` does not pay for gRPC and the daemon does not pay for the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

COMMANDS: dict[str, tuple[str, str]] = {
    "node": ("agent.commands.node", "run the node agent: DRA kubelet plugin and ResourceSlice publisher"),
    "inventory": ("agent.commands.inventory", "print this node's GPU inventory"),
    "arbiter": ("agent.commands.arbiter", "run the queue arbiter: gangs admitted through the API, whole or not at all"),
    "compute-domain-controller": (
        "agent.commands.compute_domain_controller",
        "run the ComputeDomain controller: channel claim templates and domain status",
    ),
    "simulate": ("agent.commands.simulate", "run arbiter cycles on a cluster snapshot"),
    "replay-trace": ("agent.commands.replay_trace", "replay a GPU cluster trace under placement policies"),
}

# A command's own settings of the libraries it loads, where the operator set none: gRPC reads its settings once,
# when it loads, so they are set before the command's module is imported. The arbiter's calls to the nodes wait in
# gRPC's older poller, in the calling thread: its own threads' CPU fell from 0.17-0.24 to 0.05-0.06 ms an admitted
# pod in the bench, and the arbiter's CPU from 2.50-3.27 to 2.44-2.49 ms (DESIGN.md, a seventh pass).
ENVIRONMENT: dict[str, dict[str, str]] = {"arbiter": {"GRPC_EXPERIMENTS": "-event_engine_client"}}

# Libraries only some commands need, and the extra that installs them (the node agent and the arbiter need none)
EXTRAS = {"numpy": "simulation", "jsonschema": "simulation"}


class _Parser(argparse.ArgumentParser):
    """A usage error is one line naming the command and the problem (`--help` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="gpu-dra-agent", description="Kubernetes DRA driver for NVIDIA GPUs")
    parser.add_argument("--version", action="version", version=f"gpu-dra-agent {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    raw = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in raw if not a.startswith("-")), None)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            for key, value in ENVIRONMENT.get(name, {}).items():
                os.environ.setdefault(key, value)
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                extra = EXTRAS.get((exc.name or "").partition(".")[0])
                if extra is None:
                    raise
                print(
                    f"gpu-dra-agent {name}: needs {exc.name}, from the {extra!r} extra: "
                    f"pip install 'gpu-dra-agent[{extra}]'",
                    file=sys.stderr,
                )
                return 2
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(raw)
    from agent.commands.options import SettingError, StartupFailure

    try:
        code: int = args._run(args)
    except (SettingError, StartupFailure) as exc:
        print(f"gpu-dra-agent {args.command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        return _closed_pipe()
    try:
        sys.stdout.flush()  # a reader that left early is found here when the output was buffered
    except BrokenPipeError:
        return _closed_pipe()
    return code


def _version() -> str:
    """The installed distribution's version (what `pip show` and the image's labels say)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpu-dra-agent")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _closed_pipe() -> int:
    """The reader went away (`inventory --output json | head`): stop quietly, as a pipeline expects; stdout is
    pointed at /dev/null so the interpreter's last flush does not fail again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    sys.exit(main())
