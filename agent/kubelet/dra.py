"""The DRAPlugin service (v1 and v1beta1): kubelet batches in, one result per claim out, never a batch error."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import ModuleType
from typing import Any, TypeVar

import grpc

from agent._proto.kubelet import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from agent.claims.types import ClaimRef, Preparer, PrepareResult, log_refusal, ref_problem

log = logging.getLogger(__name__)

R = TypeVar("R")


class ClaimService:
    """Version-neutral front of the Preparer: screens the kubelet's claims, contains failures.

    Screening happens here alone, at the kubelet edge: a reference that names no claim this agent can prepare
    (a UID unfit for a file name, names the API would refuse) gets its error before any path or request is
    built from it, and a claim the kubelet repeats is passed on once; the Preparer trusts what it is given.

    A Preparer exception or a missing entry becomes that claim's error, because the kubelet discards the
    whole response on a gRPC error and would retry every claim of the batch. Calls are not serialised here:
    the Preparer serialises its own state (the node lock) after reading claims, so an unprepare is never
    queued behind a prepare that waits on the API server.
    """

    def __init__(self, preparer: Preparer) -> None:
        self._preparer = preparer

    def prepare(self, claims: Sequence[ClaimRef], timeout: float | None = None) -> dict[str, PrepareResult]:
        """`timeout`: seconds left to answer (the call's deadline less a margin to send the answer)."""
        outcome = self._run("prepare", claims, lambda valid: self._preparer.prepare(valid, timeout=timeout))
        return {
            uid: PrepareResult(error=result) if isinstance(result, str) else _clean(result)
            for uid, result in outcome.items()
        }

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str]:
        return self._run("unprepare", claims, self._preparer.unprepare)

    def _run(
        self, action: str, claims: Sequence[ClaimRef], call: Callable[[Sequence[ClaimRef]], Mapping[str, R]]
    ) -> dict[str, R | str]:
        """Every claim's outcome from call, or its error message; invalid claims never reach call."""
        outcome: dict[str, R | str] = {}
        valid: dict[str, ClaimRef] = {}
        for claim in claims:
            problem = ref_problem(claim)
            if problem:
                outcome[claim.uid] = f"{action}: {problem}"
                log_refusal(log, action, claim, problem)
            else:
                valid.setdefault(claim.uid, claim)  # the kubelet may repeat a claim; do it once
        if not valid:
            return outcome
        try:
            results = call(list(valid.values()))
        except Exception as exc:
            log.exception("%s of %d claims failed", action, len(valid))
            return outcome | {uid: f"{action} failed: {type(exc).__name__}: {exc}" for uid in valid}
        for uid in valid:
            outcome[uid] = results.get(uid, f"{action}: the driver returned no result")
        return outcome


def _clean(result: PrepareResult) -> PrepareResult:
    """The kubelet ignores devices of a failed claim; do not send them."""
    return PrepareResult(error=result.error) if result.error else result


def claim_refs(messages: Iterable[Any]) -> list[ClaimRef]:
    """Request claims (any API version: the Claim message is the same) as ClaimRefs."""
    return [ClaimRef(namespace=m.namespace, uid=m.uid, name=m.name) for m in messages]


class DRAPluginServicer(dra_v1_pb2_grpc.DRAPluginServicer, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    """Serves one API version; v1 and v1beta1 share every message shape, so one class serves both.

    `api` is that version's message module (dra_v1_pb2 or dra_v1beta1_pb2).
    """

    def __init__(self, claims: ClaimService, api: ModuleType) -> None:
        self._claims = claims
        self._api = api

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = self._api.NodePrepareResourcesResponse()
        timeout = _answer_within(context)
        for uid, result in self._claims.prepare(claim_refs(request.claims), timeout).items():
            entry = response.claims[uid]
            entry.error = result.error
            for device in result.devices:
                entry.devices.add(
                    request_names=device.request_names,
                    pool_name=device.pool_name,
                    device_name=device.device_name,
                    cdi_device_ids=device.cdi_device_ids,
                )
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = self._api.NodeUnprepareResourcesResponse()
        for uid, error in self._claims.unprepare(claim_refs(request.claims)).items():
            response.claims[uid].error = error
        return response


# Time kept back from the call's deadline to send the answer: one that arrives late is thrown away.
ANSWER_MARGIN_SECONDS = 1.0


def _answer_within(context: grpc.ServicerContext) -> float | None:
    """Seconds the work of this call may take; None when the caller set no deadline."""
    remaining = context.time_remaining()
    if remaining is None or remaining > 1e6:  # grpc reports "no deadline" as a huge number
        return None
    return max(0.0, float(remaining) - ANSWER_MARGIN_SECONDS)


def add_to_server(server: grpc.Server, claims: ClaimService) -> None:
    """Serve DRAPlugin v1 and v1beta1 from the same ClaimService (so both share its serialization)."""
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DRAPluginServicer(claims, dra_v1_pb2), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DRAPluginServicer(claims, dra_v1beta1_pb2), server)
