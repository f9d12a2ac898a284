"""`--uninstall` of the leader-elected controllers' commands (`arbiter`, `compute-domain-controller`): the one way
they connect, run their uninstall and say why it could not finish."""

from __future__ import annotations

import argparse

from agent.commands.options import SettingError, StartupFailure
from agent.kube.errors import ApiError
from agent.kube.kubeconfig import KubeconfigError, connect
from agent.kube.uninstall import Controller, StillRunning, uninstall


def run_uninstall(args: argparse.Namespace, controller: Controller) -> int:
    """The controller's uninstall (agent.kube.uninstall) against --kubeconfig, its Lease in
    --leader-elect-namespace; exit 0 once it has run to its end."""
    try:
        rest = connect(args.kubeconfig)
    except KubeconfigError as exc:
        raise SettingError(str(exc)) from exc
    try:
        uninstall(rest, args.leader_elect_namespace, controller)
    except (StillRunning, ApiError) as exc:  # each step can run again: the operator runs it again
        raise StartupFailure(str(exc)) from exc
    return 0
