"""`python -m fakes.apiserver --port 0 --kubeconfig-out PATH`: serve until interrupted."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from .server import start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakes.apiserver", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (0 picks a free one)")
    parser.add_argument("--kubeconfig-out", help="write a kubeconfig for this server here")
    parser.add_argument("--history", type=int, default=1000, help="watch events kept for resuming watches")
    parser.add_argument("--drop-partitionable-fields", action="store_true",
                        help="drop sharedCounters/consumesCounters like a 1.34 server without DRAPartitionableDevices")
    parser.add_argument("--bookmark-interval", type=float, default=1.0, help="seconds between watch bookmarks")
    args = parser.parse_args(argv)
    server = start(args.port, history=args.history, drop_partitionable_fields=args.drop_partitionable_fields,
                   bookmark_interval=args.bookmark_interval)
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
