"""Device selectors for the local allocator, in DRA's CEL environment (agent.allocation.cel).

Behind the small `SelectorEngine` interface, so the allocator core can be tested with a stub.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Protocol

from agent.allocation.cel import DeviceSelector, MissingAttribute, SelectorError

__all__ = ["CelSelectors", "EvaluatedSelectors", "SelectorEngine", "SelectorError", "device_key"]


class SelectorEngine(Protocol):
    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        """True when `expression` holds for `device` (DRA's CEL `device` variable, see cel.device_variable)."""
        ...


class CelSelectors:
    """SelectorEngine over DRA's CEL environment, compiling each expression once."""

    def __init__(self) -> None:
        self._selectors: dict[str, DeviceSelector] = {}

    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        selector = self._selectors.get(expression)
        if selector is None:
            selector = self._selectors[expression] = DeviceSelector(expression)
        try:
            return selector.matches(device)
        except MissingAttribute:
            # Not Kubernetes' rule: there a selector that errors on any device fails allocation for the whole
            # claim. The local allocator treats that device as not matching instead, so a claim no device
            # matches gets NoFit, which the arbiter can try on another node. Other errors still propagate.
            return False


def device_key(device: Mapping[str, Any]) -> str:
    """A device's CEL variable as a key: equal content, equal key (candidates are rebuilt on every fit)."""
    return json.dumps(device, sort_keys=True, separators=(",", ":"))


class EvaluatedSelectors:
    """A SelectorEngine over answers computed before the fit (agent.reservation.selector_worker): per expression
    and device key, True/False, or the SelectorError message of a selector that failed on that device. A
    device not evaluated (the inventory changed since) does not match."""

    def __init__(self, answers: Mapping[tuple[str, str], bool | str]) -> None:
        self._answers = answers

    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        answer = self._answers.get((expression, device_key(device)), False)
        if isinstance(answer, str):
            raise SelectorError(answer)
        return answer
