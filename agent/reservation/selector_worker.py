"""CEL selectors of a Reserve, evaluated in a worker process within a budget (issue 17, item 7).

The `cel` package counts no cost, and its `execute` holds the GIL until it returns: one selector with nested
comprehensions ran 67.8 s inside the agent and stalled every other call, Capacity included. So the node agent
evaluates a Reserve's selectors here, before its fit and outside the book's lock, in a child process
(`python -m agent.reservation.selector_worker`) that it kills when one evaluation outlasts its budget or the
whole outlasts the caller's gRPC deadline. The first Reserve with a selector starts a worker (~0.4 s: an
interpreter and the `cel` import); a few idle ones are kept after, and a killed or crashed one is replaced on
the next call. Reserves without selectors (the arbiter's own requests, unless a claim has some) need none.

Each Reserve here holds one of the server's threads while it evaluates or waits for a worker, so at most
MAX_ADMITTED do (MAX_WORKERS evaluating, MAX_WAITING queued); the next is refused at once (NodeBusy:
RESOURCE_EXHAUSTED marked busy) rather than queued: the server keeps threads below that bound free, and
Capacity, Confirm and Release never wait behind costly selectors (issue 33, item 10).

The budget stands in for kube-apiserver's cost limit (agent.allocation.cel.MAX_COST, 1,000,000 units per
expression and device): on the development machine cel-rust runs one step of `[..].all(c, a + b + c >= 0)`
(about 7 units in cel-go: the step, three identifiers, three operators) in ~0.87 us, so the limit is ~0.12 s of
evaluation; PER_EVALUATION_S allows about twice that, so a selector the API server admitted (its estimated worst
case within the limit) does not hit it, and one a hundred times over the limit stops within a quarter second.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from agent.allocation.cel import MAX_COST, DeviceSelector, MissingAttribute, SelectorError, check_length
from agent.allocation.selectors import EvaluatedSelectors, device_key
from agent.reservation.protocol import NodeBusy

PER_EVALUATION_S = 0.25  # one selector on one device; see the module docstring
MAX_CALL_S = 10.0  # all of one Reserve's selectors, when the caller set no deadline
IDLE_WORKERS = 2
MAX_WORKERS = 4  # evaluating at once; more Reserves wait for one (within their deadline)
MAX_WAITING = 2  # Reserves waiting for a worker; past this they are refused at once
MAX_ADMITTED = MAX_WORKERS + MAX_WAITING  # server threads a Reserve with selectors may hold
MEMORY_LIMIT = 1 << 30  # a worker's address space: a selector building huge lists fails instead of swapping


class SelectorTimeout(TimeoutError):
    """The caller's deadline passed before the selectors were evaluated."""


class _Worker:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.reservation.selector_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        self._buf = b""
        self.ready = False

    @property
    def _out(self) -> IO[bytes]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    def send(self, message: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")

    def line(self, deadline: float) -> bytes | None:
        """The next line, or None when `deadline` (monotonic) passes first; EOFError when the worker died."""
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._out], [], [], remaining)[0]:
                return None
            chunk = os.read(self._out.fileno(), 1 << 16)
            if not chunk:
                raise EOFError(f"the selector worker exited ({self.proc.wait()})")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class WorkerSelectors:
    """The SelectorEvaluator the node agent's ReservationBook uses."""

    def __init__(self, per_evaluation_s: float = PER_EVALUATION_S) -> None:
        self._per_evaluation = per_evaluation_s
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_WORKERS)
        self._admitted = threading.BoundedSemaphore(MAX_ADMITTED)
        self._closed = False
        self.refused = 0  # Reserves refused as busy since start

    def _started(self, deadline: float) -> _Worker:
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is not None and worker.proc.poll() is not None:  # died while idle (killed from outside)
            worker.kill()
            worker = None
        worker = worker or _Worker()
        if not worker.ready:
            try:
                line = worker.line(deadline)
            except EOFError as e:
                worker.kill()
                raise SelectorError(f"cannot evaluate selectors: {e}") from None
            if line is None:
                worker.kill()
                raise SelectorTimeout("the deadline passed while a selector worker started")
            worker.ready = True
        return worker

    def _give_back(self, worker: _Worker, *, ok: bool) -> None:
        with self._lock:
            if ok and not self._closed and len(self._idle) < IDLE_WORKERS:
                self._idle.append(worker)
                return
        worker.kill()

    def evaluate(
        self, expressions: Sequence[str], devices: Sequence[Mapping[str, Any]], timeout_s: float | None
    ) -> EvaluatedSelectors:
        for e in expressions:  # cheap, and the same refusal the API server gives, before any process work
            check_length(e)
        deadline = time.monotonic() + min(MAX_CALL_S, timeout_s if timeout_s is not None else MAX_CALL_S)
        if not self._admitted.acquire(blocking=False):
            with self._lock:
                self.refused += 1
            raise NodeBusy(f"{MAX_ADMITTED} Reserves with selectors are already being evaluated or waiting here")
        try:
            if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise SelectorTimeout("the deadline passed while waiting for a selector worker")
            try:
                return self._evaluate(expressions, devices, deadline)
            finally:
                self._slots.release()
        finally:
            self._admitted.release()

    def _evaluate(
        self, expressions: Sequence[str], devices: Sequence[Mapping[str, Any]], deadline: float
    ) -> EvaluatedSelectors:
        worker = self._started(deadline)
        ok = False
        try:
            answers = self._run(worker, expressions, devices, deadline)
            ok = True
            return EvaluatedSelectors(answers)
        finally:
            self._give_back(worker, ok=ok)

    def _run(
        self, worker: _Worker, expressions: Sequence[str], devices: Sequence[Mapping[str, Any]], deadline: float
    ) -> dict[tuple[str, str], bool | str]:
        keys = [device_key(d) for d in devices]
        try:
            worker.send({"expressions": list(expressions), "devices": list(devices)})
        except OSError as e:
            raise SelectorError(f"cannot evaluate selectors: the worker is gone ({e})") from None
        answers: dict[tuple[str, str], bool | str] = {}
        for expression in expressions:
            for key in keys:
                try:
                    line = worker.line(min(deadline, time.monotonic() + self._per_evaluation))
                except EOFError as e:  # e.g. the memory limit, or a parser's stack overflow
                    raise SelectorError(f"selector {_short(expression)} could not be evaluated: {e}") from None
                if line is None:
                    if time.monotonic() >= deadline:
                        raise SelectorTimeout(f"the deadline passed while evaluating selector {_short(expression)}")
                    raise SelectorError(
                        f"selector {_short(expression)} exceeds the cost limit: kube-apiserver allows DRA selectors "
                        f"{MAX_COST:,} cost units, about {self._per_evaluation:g} s of evaluation per device here"
                    )
                answer = json.loads(line)
                answers[expression, key] = answer if isinstance(answer, bool) else str(answer)
        return answers

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.kill()


def _short(expression: str) -> str:
    return repr(expression if len(expression) <= 80 else expression[:77] + "...")


def _answer(selector: DeviceSelector | str, device: Mapping[str, Any]) -> bool | str:
    if isinstance(selector, str):
        return selector  # it did not compile
    try:
        return selector.matches(device)
    except MissingAttribute:
        return False  # as CelSelectors: that device does not match
    except SelectorError as e:
        return str(e)


def main() -> None:
    """The worker: for each request line {"expressions", "devices"}, one JSON line per (expression, device)
    pair in order: true, false, or the error message."""
    with contextlib.suppress(ValueError, OSError):
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for raw in sys.stdin.buffer:
        request = json.loads(raw)
        for expression in request["expressions"]:
            try:
                selector: DeviceSelector | str = DeviceSelector(expression)
            except SelectorError as e:
                selector = str(e)
            for device in request["devices"]:
                out.write(json.dumps(_answer(selector, device)).encode() + b"\n")
                out.flush()


if __name__ == "__main__":
    main()
