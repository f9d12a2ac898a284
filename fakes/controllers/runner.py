"""Both stand-ins on shared informers, one pass whenever something changed."""

from __future__ import annotations

import logging
import threading

from agent.kube.informer import Informer, start_all
from agent.kube.rest import (
    DEVICE_CLASSES,
    DEVICE_TAINT_RULES,
    NODES,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_CLAIMS,
    RESOURCE_SLICES,
    Rest,
)
from fakes.controllers.binder import Binder
from fakes.controllers.resourceclaims import ResourceClaimController

log = logging.getLogger(__name__)


class Controllers:
    def __init__(self, rest: Rest, *, bind: bool = True, period_s: float = 1.0) -> None:
        self._changed = threading.Event()
        wake = self._changed.set
        self.pods = Informer(rest, PODS, wake)
        self.claims = Informer(rest, RESOURCE_CLAIMS, wake)
        self.templates = Informer(rest, RESOURCE_CLAIM_TEMPLATES, wake)
        self.nodes = Informer(rest, NODES, wake)
        self.slices = Informer(rest, RESOURCE_SLICES, wake)
        self.classes = Informer(rest, DEVICE_CLASSES, wake)
        self.taint_rules = Informer(rest, DEVICE_TAINT_RULES, wake, optional=True)  # served from 1.37
        self.informers = [
            self.pods,
            self.claims,
            self.templates,
            self.nodes,
            self.slices,
            self.classes,
            self.taint_rules,
        ]
        self.claim_controller = ResourceClaimController(rest, self.pods, self.claims, self.templates)
        self.binder = (
            Binder(rest, self.pods, self.claims, self.nodes, self.slices, self.classes, self.taint_rules)
            if bind
            else None
        )
        self._period = period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> Controllers:
        start_all(self.informers, timeout)
        self._thread = threading.Thread(target=self._run, name="fake-controllers", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        for inf in self.informers:
            inf.stop()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def sync(self) -> int:
        writes = self.claim_controller.sync()
        if self.binder is not None:
            writes += self.binder.sync()
        return writes

    def _run(self) -> None:
        while not self._stop.is_set():
            self._changed.wait(self._period)
            self._changed.clear()
            if self._stop.is_set():
                return
            try:
                self.sync()
            except Exception:
                log.exception("fake controllers: pass failed")
