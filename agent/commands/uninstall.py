"""`--uninstall` of the leader-elected controllers' commands (`arbiter`, `compute-domain-controller`): the one way
they connect, run their uninstall and say why it could not finish."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from agent.commands.options import SettingError, StartupFailure
from agent.kube.errors import ApiError
from agent.kube.kubeconfig import KubeconfigError, connect
from agent.kube.rest import Rest
from agent.kube.uninstall import StillRunning


def run_uninstall(args: argparse.Namespace, uninstall: Callable[[Rest, str], object]) -> int:
    """`uninstall(rest, namespace of the Lease)` against --kubeconfig; exit 0 once it has run to its end."""
    try:
        rest = connect(args.kubeconfig)
    except KubeconfigError as exc:
        raise SettingError(str(exc)) from exc
    try:
        uninstall(rest, args.leader_elect_namespace)
    except (StillRunning, ApiError) as exc:  # each step can run again: the operator runs it again
        raise StartupFailure(str(exc)) from exc
    return 0
