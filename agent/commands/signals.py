"""How the daemons (node, arbiter) stop: SIGTERM or SIGINT, handled the same way in both."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType


def stop_on_signals(stop: Callable[[], None], log: logging.Logger) -> None:
    """SIGTERM and SIGINT call `stop` once and say so once; a repeat while stopping (a kubelet's second
    SIGTERM, Ctrl-C pressed twice) is noted at debug level only."""
    received = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if received.is_set():
            log.debug("received %s again, already shutting down", name)
            return
        received.set()
        log.info("received %s, shutting down", name)
        stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
