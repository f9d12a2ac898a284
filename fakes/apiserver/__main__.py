"""`python -m fakes.apiserver --kubernetes-version 1.37 --port 0 --kubeconfig-out PATH`: serve until interrupted."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from .server import start
from .versions import ENVIRONMENT, SUPPORTED, default_version


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakes.apiserver", description=__doc__)
    parser.add_argument(
        "--kubernetes-version",
        default=default_version(),
        choices=SUPPORTED,
        help=f"the minor release to play: /version, served APIs, schemas, rules, gate defaults "
        f"(default ${ENVIRONMENT}, else 1.37)",
    )
    parser.add_argument(
        "--feature-gates", default="", help="gate overrides as kube-apiserver takes them, e.g. DRADeviceTaints=false"
    )
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--kubeconfig-out", help="write a kubeconfig for this server here")
    parser.add_argument("--history", type=int, default=1000, help="watch events kept for resuming watches")
    parser.add_argument(
        "--drop-partitionable-fields",
        action="store_true",
        help="the same as --feature-gates DRAPartitionableDevices=false",
    )
    parser.add_argument("--bookmark-interval", type=float, default=1.0, help="seconds between watch bookmarks")
    args = parser.parse_args(argv)
    gates: dict[str, bool] = {}
    for item in filter(None, (p.strip() for p in args.feature_gates.split(","))):
        name, sep, value = item.partition("=")
        if not sep or value.lower() not in ("true", "false"):
            parser.error(f"--feature-gates: {item!r} is not NAME=true or NAME=false")
        gates[name] = value.lower() == "true"
    try:
        server = start(
            args.port,
            kubernetes_version=args.kubernetes_version,
            feature_gates=gates,
            history=args.history,
            drop_partitionable_fields=args.drop_partitionable_fields,
            bookmark_interval=args.bookmark_interval,
        )
    except ValueError as exc:
        parser.error(str(exc))
    if args.kubeconfig_out:
        server.write_kubeconfig(args.kubeconfig_out)
    print(server.url, flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
