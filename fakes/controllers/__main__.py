"""`python -m fakes.controllers --kubeconfig F`: run the stand-ins until interrupted."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading

from agent.kube.kubeconfig import connect
from fakes.controllers.runner import Controllers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakes.controllers", description=__doc__)
    parser.add_argument("--kubeconfig", required=True, help="kubeconfig of the API server to act on")
    parser.add_argument("--no-binding", action="store_true", help="only the resourceclaim controller")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    controllers = Controllers(connect(args.kubeconfig), bind=not args.no_binding).start()
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    with contextlib.suppress(KeyboardInterrupt):
        done.wait()
    controllers.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
